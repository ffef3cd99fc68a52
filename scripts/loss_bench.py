"""Time the LM-head loss alone on the GPU: HF's loss on full logits against the vocab-chunked loss,
with its Triton chunk kernels and with the plain-torch chunk path (the spec), at Llama-3.1-8B's head
shape (4096 x 128256, bf16) and several token counts. A plain head (its gradient written), so the
fused optimizer is not in the timing. Forward + backward per iteration, CUDA events, warm-up first,
median of 20; peak allocated memory above the inputs, GiB (2^30).

    python3 scripts/loss_bench.py --out results.json --tokens 512 4096
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Callable

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from forge_core import chunked_lm_head_cross_entropy  # noqa: E402
from forge_core.kernels import cross_entropy  # noqa: E402

WIDTH, VOCAB = 4096, 128256


def _time(step: Callable[[], None], warmup: int = 5, timed: int = 20) -> tuple[float, float]:
    """(median ms, peak GiB above what was allocated before)."""
    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(timed):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times), (torch.cuda.max_memory_allocated() - base) / 2 ** 30


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--tokens", type=int, nargs="+", default=[512, 4096])
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("loss_bench: needs a CUDA GPU")
    from transformers.loss.loss_utils import ForCausalLMLoss

    torch.manual_seed(0)
    head = nn.Linear(WIDTH, VOCAB, bias=False, device="cuda", dtype=torch.bfloat16)
    rows = []
    kernels_usable = cross_entropy.usable_for
    for tokens in args.tokens:
        hidden = torch.randn(1, tokens, WIDTH, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        labels = torch.randint(0, VOCAB, (1, tokens), device="cuda")

        def hf() -> None:
            ForCausalLMLoss(head(hidden), labels, VOCAB).backward()
            head.weight.grad = None

        def chunked() -> None:
            chunked_lm_head_cross_entropy(hidden, head, labels).backward()
            head.weight.grad = None

        arms = {"hf_full_logits": (hf, kernels_usable), "chunked_kernels": (chunked, kernels_usable),
                "chunked_torch_path": (chunked, lambda tensor: False)}
        for rounds in range(2):   # two interleaved rounds per arm: the spread between them is the noise
            for name, (step, usable) in arms.items():
                cross_entropy.usable_for = usable
                try:
                    ms, gib = _time(step)
                finally:
                    cross_entropy.usable_for = kernels_usable
                rows.append({"tokens": tokens, "arm": name, "round": rounds, "ms": round(ms, 3),
                             "peak_above_inputs_gib": round(gib, 3)})
                print(f"tokens {tokens:5d}  {name:20s} round {rounds}: {ms:8.3f} ms  peak +{gib:.2f} GiB", flush=True)
        del hidden
    args.out.write_text(json.dumps({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                                    "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
