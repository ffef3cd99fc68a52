"""Step-level A/B inside one process: the same warmed-up arm captured as several CUDA graphs that
differ in one thing, timed in alternating rounds (GPU; one process per method).

    python3 scripts/graph_ab.py --out $OUT/ab.jsonl --method forge_int8 tuned priority \\
        "pin:14336x4096,4096x14336=64x128x32/w8/s4/sp2/r128/ptr"

Arms: ``tuned`` (the step as a sweep cell captures it); ``priority`` (captured on the highest-priority
stream: the fused updates' side stream keeps the default priority, so the critical path's CTAs are
dispatched first; torch >= 2.10 instantiates graphs with cudaGraphInstantiateFlagUseNodePriority);
``pin:SHAPES=SPEC`` (the fused kernel of those weight shapes, at this cell's tokens, pinned to the
tile ``SPEC`` of scripts/kernel_variants.py instead of the tuner's pick); ``sms:N`` (the Gluon kernel's
persistent grid capped at N programs, ``hopper_ws.PROGRAM_CAP``, so that the backward's kernels find
free SMs beside the side-stream updates); ``dense_embedding`` (the vocabulary embedding back on its dense
``.grad``, as ``fuse(embedding_rows=False)``, against the row-gradient embedding of the other arms);
``recompute_logits`` (the chunked loss's backward recomputes the logits, as with ``keep_logits_bytes=0``,
against the kept logits of the other arms at small token counts). Why: across boots the step
moves by more than a kernel change, and a kernel timed alone is not timed at the power cap where
the whole step runs (~700 W on the H100, docs/kernel_notes.md session 13); rounds of 20 replays of
each graph in turn, with NVML's energy counter read around each round, compare arms at one clock.
Llama-3.1-8B, lean activations; --batch / --seq pick the cell (headline: 1 x 512).
"""
from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))


def parse_arm(spec: str) -> tuple[str, set[tuple[int, int]] | None, object | None]:
    """(kind, weight shapes, tile config) of one arm spec, or SystemExit with a one-line reason: checked
    before the 8B model is built, so a typo costs no device time."""
    from kernel_variants import parse_config

    if spec in ("tuned", "priority", "dense_embedding", "recompute_logits"):
        return spec, None, None
    if spec.startswith("sms:"):
        programs = spec[4:]
        if not programs.isdigit() or int(programs) < 1:
            raise SystemExit(f"graph_ab: arm {spec!r} needs a program count >= 1 (e.g. sms:120)")
        return "sms", None, int(programs)
    if spec.startswith("pin:") and "=" in spec:
        shapes_text, config_text = spec[4:].split("=", 1)
        try:
            shapes = {tuple(int(d) for d in s.split("x")) for s in shapes_text.split(",")}
        except ValueError:
            shapes = set()
        if not shapes or any(len(shape) != 2 for shape in shapes):
            raise SystemExit(f"graph_ab: cannot read the weight shapes of arm {spec!r} (e.g. 14336x4096,4096x14336)")
        return "pin", shapes, parse_config(config_text)
    raise SystemExit(f"graph_ab: unknown arm {spec!r} (tuned, priority, pin:SHAPES=SPEC, sms:N, dense_embedding, "
                     "recompute_logits)")


def capture_arm(spec: str, arm, batches: list):
    """One graph of ``arm``'s step for the arm ``spec`` (the tuner's picks are restored afterwards)."""
    import torch
    from forge_bench import cell as cell_mod
    from forge_core.kernels import fused as fused_module

    def warmed_graph(eager_steps: int):
        """Eager steps outside the capture (they compile, tune and re-make launch plans), then the graph."""
        cell_mod._eager_steps(arm, batches, eager_steps, side_stream=True)
        torch.cuda.synchronize()
        return cell_mod.GraphedStep(arm, batches[0])

    tokens = batches[0]["input_ids"].numel()
    kind, shapes, config = parse_arm(spec)
    if kind == "tuned":
        return cell_mod.GraphedStep(arm, batches[0])
    if kind == "priority":
        return cell_mod.GraphedStep(arm, batches[0], torch.cuda.Stream(priority=-100))
    if kind == "pin":
        saved = dict(fused_module._TUNED)
        pinned = [key for key in saved if key[0] in shapes and key[1] == tokens]
        if not pinned:
            raise SystemExit(f"graph_ab: no tuned weight of shape {sorted(shapes)} at {tokens} tokens; tuned: "
                             f"{sorted({(k[0], k[1]) for k in saved})}")
        for key in pinned:
            fused_module.check_config(config, key[5])
            fused_module._TUNED[key] = config
        fused_module._PLANS.clear()
        try:
            return warmed_graph(1)                                     # the pinned tile compiled outside the capture
        finally:
            fused_module._TUNED.clear()
            fused_module._TUNED.update(saved)
            fused_module._PLANS.clear()
    if kind == "dense_embedding":
        from forge_core.embedding import ForgeEmbedding
        row_embeddings = [m for m in arm.model.modules() if isinstance(m, ForgeEmbedding)]
        if not row_embeddings:
            raise SystemExit("graph_ab: arm dense_embedding needs a FORGE method whose embedding records rows")
        sinks = [m.forge_row_sink for m in row_embeddings]
        for module in row_embeddings:
            module.forge_row_sink = None          # a plain embedding forward: autograd writes the dense .grad
        try:
            return warmed_graph(2)                                     # the dense-gradient update tuned first
        finally:
            for module, sink in zip(row_embeddings, sinks):
                module.forge_row_sink = sink
    if kind == "recompute_logits":
        from forge_core import lm_head_loss
        budget = lm_head_loss.DEFAULT_KEEP_LOGITS_BYTES
        lm_head_loss.DEFAULT_KEEP_LOGITS_BYTES = 0
        try:
            return warmed_graph(1)
        finally:
            lm_head_loss.DEFAULT_KEEP_LOGITS_BYTES = budget
    if kind == "sms":
        from forge_core.kernels import hopper_ws
        hopper_ws.PROGRAM_CAP = config
        fused_module._PLANS.clear()
        try:
            return warmed_graph(2)                 # plans re-made first: their direct launch keeps the capped grid
        finally:
            hopper_ws.PROGRAM_CAP = None
            fused_module._PLANS.clear()
    raise AssertionError(kind)


def time_rounds(steps: dict, batches: list, rounds: int, replays: int) -> dict[str, list[dict]]:
    """Per arm and round: the median replay ms and the energy per step (J) and mean power (W)."""
    import torch
    from forge_bench.telemetry import nvml_snapshot, window_energy
    out: dict[str, list[dict]] = {name: [] for name in steps}
    gc.collect()
    gc.disable()
    try:
        for round_index in range(rounds):
            shift = round_index % len(steps)
            names = list(steps)
            for name in names[shift:] + names[:shift]:
                starts = [torch.cuda.Event(enable_timing=True) for _ in range(replays)]
                ends = [torch.cuda.Event(enable_timing=True) for _ in range(replays)]
                before, started = nvml_snapshot(), time.perf_counter()
                for i in range(replays):
                    starts[i].record()
                    steps[name](batches[i % len(batches)])
                    ends[i].record()
                torch.cuda.synchronize()
                after = nvml_snapshot()
                out[name].append(dict(ms=statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends)),
                                      sm_clock_mhz=after.get("sm_clock_mhz"),
                                      **window_energy(before, after, time.perf_counter() - started, replays)))
    finally:
        gc.enable()
    return out


def median_of(rounds: list[dict], key: str) -> float | None:
    """``key``'s median over the rounds that have it (no energy counter: None), never a NaN in it."""
    values = [r[key] for r in rounds if key in r]
    return statistics.median(values) if values else None


def probe(method: str, specs: list[str], batch: int, seq: int, rounds: int, replays: int) -> dict:
    import torch
    from forge_bench import cell as cell_mod
    from forge_bench.profile_step import warmed_up_arm
    from forge_core.kernels.fused import describe_tuned_configs

    arm, batches = warmed_up_arm("graph_ab", "llama-3.1-8b", batch, seq, method, cell_mod.GRAPH_EAGER_WARMUP,
                                 "bfloat16", "lean", capturable=True)
    tuned = describe_tuned_configs()
    gc.collect()
    torch.cuda.empty_cache()
    steps = {spec: capture_arm(spec, arm, batches) for spec in specs}
    for step in steps.values():
        for i in range(5):
            step(batches[i % len(batches)])
    torch.cuda.synchronize()
    per_round = time_rounds(steps, batches, rounds, replays)
    summary = {name: {key: median_of(rs, key) for key in ("ms", "energy_j_per_step", "power_w_mean")}
               for name, rs in per_round.items()}
    return dict(method=method, batch=batch, seq=seq, rounds=rounds, replays=replays, summary=summary,
                per_round=per_round, kernel_configs=tuned, torch=torch.__version__,
                device=torch.cuda.get_device_name())


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True, help="JSON lines file, appended to")
    parser.add_argument("--method", required=True)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--replays", type=int, default=20)
    parser.add_argument("arms", nargs="+", help="tuned, priority, pin:SHAPES=SPEC, sms:N, dense_embedding, "
                        "recompute_logits")
    args = parser.parse_args()
    for spec in args.arms:
        parse_arm(spec)
    import torch
    if not torch.cuda.is_available():
        raise SystemExit("graph_ab: needs a CUDA GPU")
    record = probe(args.method, args.arms, args.batch, args.seq, args.rounds, args.replays)
    with open(args.out, "a") as handle:
        handle.write(json.dumps(record) + "\n")
    print(json.dumps(record["summary"]), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
