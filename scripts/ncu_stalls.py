"""Where the warps of a warp-specialized kernel wait, per partition, from Nsight Compute's SASS page.

Why: ncu's own summary mixes every partition's stalls; what a pipeline change needs to know is which
partition waits on which mbarrier (the MMA warps on the operand ring, the epilogue on G or on the
state ring) and for what share of that partition's time. Session 23 read that off the SASS by hand.
Input: the per-instruction CSV that ``scripts/ncu_ws.py`` runs produce
(``ncu --import REP --page source --csv --print-source sass``, gzip or plain), e.g.
``results/kernels/h100/ws_s23/call6/ws_bf16_sass.csv.gz``.

    python3 scripts/ncu_stalls.py results/kernels/h100/ws_s23/call6/ws_bf16_sass.csv.gz [--json]

How it splits: a partition's code starts at a ``USETMAXREG`` (its register budget); a region with
``HGMMA`` is the MMA warps', one with ``UTMALDG`` a loader's, one with ``STG`` the epilogue's, one
with nothing but ``BAR.SYNC`` the idle warps that pad the program to whole warpgroups. An mbarrier
wait is a ``SYNCS.PHASECHK`` and the ``@!P BRA`` after it (where the warp sits until the phase
flips); its out-of-line retry block (after ``EXIT``) counts for the partition it branches back to.
Waits are named by the barrier's shared-memory offset and by the first memory or MMA instruction
after the wait (``HGMMA``: the operand ring; ``STS``: parking G; ``LDS``: reading G or a slab).
"""
from __future__ import annotations

import argparse
import csv
import dataclasses
import gzip
import json
import re
import sys
from pathlib import Path

_WAIT = re.compile(r"SYNCS\.PHASECHK\S*\s+(P\d),\s*\[([^\]]*)\]")
_BRANCH = re.compile(r"^@!(P\d)\s+BRA\s+(0x[0-9a-f]+)")
_LOOKBACK = 40
"""Instructions searched back from a branch for its wait, and ahead of a wait for its hint."""
SAMPLES = "Warp Stall Sampling (All Samples)"
_HINTS = ("HGMMA", "UTMALDG", "STS", "LDS", "LDG", "STG")


@dataclasses.dataclass
class Instruction:
    address: int
    text: str
    samples: int

    @property
    def opcode(self) -> str:
        words = self.text.split()
        return words[1] if words and words[0].startswith("@") and len(words) > 1 else (words[0] if words else "")


def read_sass(path: Path) -> list[Instruction]:
    """The SASS rows of one kernel: address, instruction text, all warp-stall samples."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", newline="") as handle:
        rows = list(csv.reader(handle))
    header_at = next((i for i, row in enumerate(rows) if row[:2] == ["Address", "Source"]), None)
    if header_at is None:
        raise SystemExit(f"ncu_stalls: {path} has no 'Address,Source' header: not an ncu SASS source page CSV")
    if SAMPLES not in rows[header_at]:
        raise SystemExit(f"ncu_stalls: {path} has no '{SAMPLES}' column: profile with warp-stall sampling "
                         "(ncu --set full, or --section SourceCounters)")
    column = rows[header_at].index(SAMPLES)
    return [Instruction(int(row[0], 16), row[1].strip(), int(row[column] or 0))
            for row in rows[header_at + 1:] if len(row) > column and row[0].startswith("0x")]


def _kind(body: list[Instruction]) -> str:
    ops = {i.opcode.split(".")[0] for i in body}
    if "HGMMA" in ops:
        return "mma"
    if "UTMALDG" in ops:
        return "loader"
    if "STG" in ops:
        return "epilogue"
    if "EXIT" in ops:
        return "tail"
    if "BAR" in ops and not ops & {"SYNCS", "LDS", "LDG", "STS"}:
        return "idle"
    return "setup"


def regions(sass: list[Instruction]) -> list[tuple[str, int, int]]:
    """(name, first index, end index) of each partition's code, split at USETMAXREG; a kind met more
    than once is numbered in code order (loader1, loader2)."""
    cuts = [i for i, ins in enumerate(sass) if ins.opcode.startswith("USETMAXREG")]
    spans = [(_kind(sass[a:b]), a, b) for a, b in zip([0, *cuts], [*cuts, len(sass)]) if a < b]
    kinds = [k for k, _, _ in spans]
    numbered = ("loader", "mma", "epilogue")
    return [(f"{k}{kinds[:n + 1].count(k)}" if k in numbered and kinds.count(k) > 1 else k, a, b)
            for n, (k, a, b) in enumerate(spans)]


def _barrier(operand: str) -> str:
    """An mbarrier's name: its fixed shared-memory offset where the operand has one, else the operand."""
    offsets = re.findall(r"0x[0-9a-f]+", operand)
    return offsets[-1] if offsets and int(offsets[-1], 16) >= 0x1000 else f"[{operand}]"


def _hint(sass: list[Instruction], index: int) -> str:
    for ins in sass[index + 1:index + _LOOKBACK]:
        op = ins.opcode.split(".")[0]
        if op in _HINTS:
            return op
    return "-"


def attribute(sass: list[Instruction]) -> dict:
    """Samples per partition and, within each, per mbarrier wait (offset, samples, share, hint)."""
    spans = regions(sass)
    by_address = {ins.address: i for i, ins in enumerate(sass)}

    def owner(index: int) -> str:
        return next(name for name, start, end in spans if start <= index < end)

    totals: dict[str, int] = {}
    for name, start, end in spans:
        totals[name] = totals.get(name, 0) + sum(i.samples for i in sass[start:end])
    waits: dict[tuple[str, str], dict] = {}
    counted: set[int] = set()          # a PHASECHK's own samples count once, however many branches test it
    for index, ins in enumerate(sass):
        branch = _BRANCH.match(ins.text)
        if branch is None:
            continue
        # the wait whose predicate this branch tests: the latest PHASECHK that set it
        found = next(((j, m) for j in range(index - 1, max(index - _LOOKBACK, -1), -1)
                      if (m := _WAIT.search(sass[j].text)) and m.group(1) == branch.group(1)), None)
        if found is None:
            continue
        check, wait = found
        barrier = _barrier(wait.group(2))
        samples = ins.samples + (sass[check].samples if check not in counted else 0)
        counted.add(check)
        home = owner(check)
        name, hint = home, _hint(sass, index)
        if name == "tail":
            # an out-of-line retry block (wait, branch to itself, branch back): it counts for the
            # partition it returns to
            back = next((by_address.get(int(b.text.split()[-1], 16)) for b in sass[index + 1:index + 3]
                         if b.opcode == "BRA" and not b.text.startswith("@")), None)
            if back is None:
                continue
            name, hint = owner(back), _hint(sass, back)
            totals["tail"] -= samples
            totals[name] += samples
        entry = waits.setdefault((name, barrier), dict(partition=name, barrier=barrier, samples=0, sites=0,
                                                       next=hint))
        entry["samples"] += samples
        entry["sites"] += home != "tail"
    everything = sum(totals.values()) or 1
    parts = []
    for name in dict.fromkeys(n for n, _, _ in spans):
        total = totals.get(name, 0)
        mine = sorted((w for w in waits.values() if w["partition"] == name), key=lambda w: -w["samples"])
        parts.append(dict(partition=name, samples=total, share_of_all=total / everything,
                          waits=[dict(w, share_of_partition=w["samples"] / (total or 1)) for w in mine]))
    return dict(total_samples=everything, partitions=parts)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("csv", type=Path)
    parser.add_argument("--json", action="store_true", help="print the attribution as JSON")
    args = parser.parse_args(argv)
    if not args.csv.exists():
        raise SystemExit(f"ncu_stalls: no such file: {args.csv}")
    result = attribute(read_sass(args.csv))
    if args.json:
        print(json.dumps(result, indent=1))
        return 0
    print(f"{args.csv}: {result['total_samples']} warp-stall samples")
    for part in result["partitions"]:
        if part["samples"] == 0:
            continue
        print(f"{part['partition']:10s} {part['samples']:7d} samples  {part['share_of_all']:6.1%} of all")
        for wait in part["waits"]:
            if wait["samples"]:
                print(f"    waits on mbarrier {wait['barrier']} (then {wait['next']}; wait sites: {wait['sites']}): "
                      f"{wait['samples']:6d}  {wait['share_of_partition']:6.1%} of this partition")
    return 0


if __name__ == "__main__":
    sys.exit(main())
