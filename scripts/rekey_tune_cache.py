"""Re-key a tune cache's tile choices to this tree's kernel, so that an A/B of a kernel change runs
both sides on the same tiles.

Why: every entry of a ``FORGE_TUNE_CACHE`` file is keyed by a fingerprint of the kernel's source
(``fused.tuning_fingerprint``), so any change to the kernel makes the new tree tune again, and the
tuner's pick among candidates a few percent apart moves between runs (docs/kernel_notes.md, session
13): an old-vs-new step A/B would then measure the tuner as well as the code. This writes the same
choices under the fingerprints this tree computes (each entry keeps its own Triton version and GPU
name); ``--check`` only counts the entries this tree would already accept. Use the output for A/Bs,
not as a tuning result: its tiles were chosen for the other kernel. Gluon-or-Triton choices
(``ws_choice``, keys ending in ``'hopper_ws'``) are re-keyed too, with the candidates their weight shape
is offered on a contiguous, aligned call.

    python scripts/rekey_tune_cache.py results/h100/run35/tune_cache.json /tmp/rekeyed.json
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from forge_core.kernels import fused, tune_cache, ws_choice  # noqa: E402
from forge_core.rules import get_rule  # noqa: E402


def rekey(entries: dict) -> tuple[dict, int]:
    """(entries under this tree's fingerprints, how many keys changed)."""
    out, changed = {}, 0
    for key, entry in entries.items():
        old_fingerprint, key_text = tune_cache.split_entry_key(key)
        try:
            tuning_key = eval(key_text, {"__builtins__": {}}, {"torch": torch})      # noqa: S307 - our own repr
            (m, n), tokens, input_dtype, _, rule_name, state_dtype = tuning_key[:6]
            rule = get_rule(rule_name)
        except Exception as exc:  # noqa: BLE001
            raise SystemExit(f"rekey_tune_cache: cannot read entry key {key!r} ({exc})") from None
        if tuning_key[-1] == "hopper_ws":          # a Gluon-or-Triton choice (ws_choice.chosen)
            try:
                triton_tile = fused.TileConfig(**entry["triton_tile"])
            except (KeyError, TypeError) as exc:
                raise SystemExit(f"rekey_tune_cache: entry {key!r} names no Triton tile ({exc})") from None
            identity = fused.ws_identity(rule.epilogue, triton_tile, entry["triton"], entry["device"],
                                         graphed=tuning_key[-2] == "graph")
            candidates = ws_choice.shape_candidates(m, n, state_dtype, len(rule.state_names))
            fingerprint = ws_choice.disk_fingerprint(identity, candidates)
        else:
            input_bytes = torch.empty((), dtype=input_dtype).element_size()
            candidates = fused.tuning_candidates(m, n, tokens, input_bytes, state_dtype)
            fingerprint = fused.tuning_fingerprint(rule.epilogue, candidates, entry["triton"], entry["device"])
        changed += fingerprint != old_fingerprint
        out[tune_cache.entry_key(tuning_key, fingerprint)] = entry
    return out, changed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("source", type=Path)
    parser.add_argument("target", type=Path, nargs="?")
    parser.add_argument("--check", action="store_true", help="only report how many entries this tree accepts")
    args = parser.parse_args(argv)
    try:
        data = json.loads(args.source.read_text())
        entries = data["entries"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise SystemExit(f"rekey_tune_cache: {args.source} is not a tune cache ({exc})") from None
    rekeyed, changed = rekey(entries)
    print(f"{len(entries) - changed} of {len(entries)} entries already match this tree's kernel")
    if not args.check:
        if args.target is None:
            raise SystemExit("rekey_tune_cache: name the file to write (or pass --check)")
        tune_cache.write(args.target, rekeyed)
        print(f"wrote {len(rekeyed)} entries to {args.target}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
