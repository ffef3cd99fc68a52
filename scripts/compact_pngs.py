"""Re-write committed PNG figures with a 256-colour palette (``forge_bench.report.figures.compact_png``),
which new reports and kernel-benchmark figures already get when written.

Why: the tracked tree travels to the GPU machine with the carried wheels under a 64 MiB cap, and the
RGBA PNGs of earlier reports were about two thirds of the tree's figure bytes.

    python scripts/compact_pngs.py            # every tracked *.png
    python scripts/compact_pngs.py a.png b.png
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from forge_bench.report.figures import compact_png  # noqa: E402


def main(argv: list[str]) -> int:
    paths = [Path(a) for a in argv] or [Path(p) for p in subprocess.run(
        ["git", "ls-files", "*.png"], check=True, capture_output=True, text=True).stdout.split()]
    before = sum(p.stat().st_size for p in paths)
    for path in paths:
        compact_png(path)
    after = sum(p.stat().st_size for p in paths)
    print(f"{len(paths)} PNG files: {before / 2**20:.1f} MiB -> {after / 2**20:.1f} MiB")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
