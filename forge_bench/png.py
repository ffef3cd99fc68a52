"""Small PNGs for every figure forge-bench writes (the report's and the kernel benchmark's)."""
from __future__ import annotations

import io
from pathlib import Path


def compact_png(path: Path) -> None:
    """Re-write an opaque PNG with a 256-colour palette (no dithering) when that is smaller.

    Why: matplotlib writes RGBA; a chart holds a few dozen colours plus their anti-aliased edges, so
    a palette keeps it visually the same at about a third of the bytes. Committed reports travel with
    the tree to the GPU machine, whose copy is capped (64 MiB with the wheels). Deterministic, so the
    report's bytes stay reproducible. A PNG with any transparent pixel is left as it is, and so is
    every PNG where Pillow is missing (matplotlib needs it, so it should not be)."""
    try:
        from PIL import Image
    except ImportError:
        return

    with Image.open(path) as image:
        image.load()
    if image.mode == "P":
        return
    if "A" in image.getbands() and image.getchannel("A").getextrema()[0] < 255:
        return
    palette = image.convert("RGB").quantize(colors=256, method=Image.Quantize.MEDIANCUT, dither=Image.Dither.NONE)
    buffer = io.BytesIO()
    palette.save(buffer, format="PNG", optimize=True)
    if buffer.tell() < path.stat().st_size:
        path.write_bytes(buffer.getvalue())
