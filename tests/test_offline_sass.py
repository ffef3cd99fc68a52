"""scripts/offline_sass.py: the fused kernel compiled for sm_90 on a machine without a GPU, and the
count of its epilogue's instructions."""
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))


def test_offline_sass_counts_only_the_epilogue():
    """scripts/offline_sass.py: opcodes after the last warpgroup MMA wait, NOPs and branches left out."""
    from offline_sass import epilogue_opcodes

    sass = "\n".join([
        "        /*0100*/                   HGMMA.64x64x16.F32.BF16 R24, gdesc[UR4], R24 ;",
        "        /*0110*/                   FFMA R1, R2, R3, R4 ;",
        "        /*0120*/                   WARPGROUP.DEPBAR.LE gsb0, 0x0 ;",
        "        /*0130*/                   FMUL R5, R6, R7 ;",
        "        /*0140*/              @!P0 FFMA.FTZ R5, R6, R7, R8 ;",
        "        /*0150*/                   NOP ;",
        "        /*0160*/                   BRA 0x170 ;",
        "        /*0170*/                   EXIT ;",
    ])
    assert dict(epilogue_opcodes(sass)) == {"FMUL": 1, "FFMA": 1, "EXIT": 1}


def test_offline_sass_compiles_the_int8_tile_for_sm90():
    """The whole path on a CPU machine: the production plan's arguments, Triton's sm_90 compile, nvdisasm
    (in a process without TRITON_INTERPRET, which would replace the kernel)."""
    import pathlib
    import subprocess

    import triton
    if not (pathlib.Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "nvdisasm").exists():
        pytest.skip("this Triton wheel carries no nvdisasm")
    script = pathlib.Path(__file__).resolve().parents[1] / "scripts" / "offline_sass.py"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    args = [sys.executable, str(script), "--shape", "256x256", "--tokens", "64", "--state", "int8", "--tile",
            "64x64x32", "--warps", "4", "--stages", "2", "--maxnreg", "128", "--prefetch", "--top", "3"]
    done = subprocess.run(args, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "registers" in done.stdout and "per weight element" in done.stdout and "FFMA" in done.stdout
    assert done.stdout.startswith(f"compiled by Triton {triton.__version__} (")
    refused = subprocess.run(args, env={**env, "TRITON_INTERPRET": "1"}, capture_output=True, text=True, timeout=240)
    assert refused.returncode == 1 and "unset TRITON_INTERPRET" in refused.stderr
