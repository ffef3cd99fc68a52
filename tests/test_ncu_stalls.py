"""scripts/ncu_stalls.py: warp-stall samples split by partition and by the mbarrier each partition waits on."""
import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "ncu_stalls.py"
spec = importlib.util.spec_from_file_location("ncu_stalls", SCRIPT)
ncu_stalls = importlib.util.module_from_spec(spec)
sys.modules["ncu_stalls"] = ncu_stalls          # its dataclass looks its module up
spec.loader.exec_module(ncu_stalls)

CALL6 = ROOT / "results" / "kernels" / "h100" / "ws_s23" / "call6"
HEADER = ('"Address","Source","Warp Stall Sampling (All Samples)","# Samples"\n')


def _csv(tmp_path: Path, lines: list[tuple[int, str, int]]) -> Path:
    path = tmp_path / "k_sass.csv"
    body = "".join(f'"{hex(0x1000 + 16 * i)}","{text}","{samples}","{samples}"\n' for i, text, samples in lines)
    path.write_text('"Kernel Name","k",\n' + HEADER + body)
    return path


def test_a_retry_block_counts_for_the_partition_it_returns_to(tmp_path):
    # loader (TMA), MMA warps waiting before their HGMMA, then EXIT and the MMA wait's retry block
    lines = [(0, "USETMAXREG.DEALLOC.CTAPOOL 0x18", 0), (1, "UTMALDG.2D [UR8], [UR4]", 5),
             (2, "USETMAXREG.TRY_ALLOC.CTAPOOL UP0, 0xd0", 0),
             (3, "SYNCS.PHASECHK.TRANS64.TRYWAIT P1, [UR9+0x35150], R2", 4),
             (4, "MOV R3, UR6", 1), (5, f"@!P1  BRA {hex(0x1000 + 16 * 9)}", 60),
             (6, "HGMMA.64x128x16.F32.BF16 R24, gdesc[UR16], R24", 30),
             (7, "USETMAXREG.TRY_ALLOC.CTAPOOL UP0, 0x78", 0), (8, "EXIT", 0),
             (9, "SYNCS.PHASECHK.TRANS64.TRYWAIT P1, [UR9+0x35150], R2", 7),
             (10, f"@!P1  BRA {hex(0x1000 + 16 * 9)}", 3), (11, f"BRA {hex(0x1000 + 16 * 6)}", 0)]
    result = ncu_stalls.attribute(ncu_stalls.read_sass(_csv(tmp_path, lines)))
    parts = {p["partition"]: p for p in result["partitions"]}
    assert result["total_samples"] == 110
    assert parts["loader"]["samples"] == 5 and parts["loader"]["waits"] == []
    mma = parts["mma"]
    assert mma["samples"] == 4 + 1 + 60 + 30 + 7 + 3 and parts["tail"]["samples"] == 0
    assert mma["waits"] == [dict(partition="mma", barrier="0x35150", samples=4 + 60 + 7 + 3, sites=1,
                                 next="HGMMA", share_of_partition=74 / 105)]


def test_session_23_bf16_profile_the_mma_warps_wait_on_their_operands():
    """The committed Nsight run of the 128x128 bf16 candidate (gate, 512 tokens): session 24's reading."""
    result = ncu_stalls.attribute(ncu_stalls.read_sass(CALL6 / "ws_bf16_sass.csv.gz"))
    parts = {p["partition"]: p for p in result["partitions"]}
    assert set(parts) == {"setup", "loader1", "loader2", "mma", "idle", "epilogue", "tail"}
    assert sum(p["samples"] for p in parts.values()) == result["total_samples"] == 30251
    operands = parts["mma"]["waits"][0]
    assert (operands["barrier"], operands["next"], operands["samples"]) == ("0x35150", "HGMMA", 6341)
    assert operands["share_of_partition"] == pytest.approx(0.640, abs=1e-3)
    waits_for_g, waits_for_slabs = parts["epilogue"]["waits"][:2]
    assert (waits_for_g["sites"], waits_for_slabs["sites"]) == (1, 8)      # one per half / per unrolled slab
    assert waits_for_g["share_of_partition"] == pytest.approx(0.344, abs=1e-3)
    assert parts["idle"]["share_of_all"] == pytest.approx(0.164, abs=1e-3)


def test_the_int8_profile_matches_session_23s_hand_reading():
    result = ncu_stalls.attribute(ncu_stalls.read_sass(CALL6 / "ws_int8_sass.csv.gz"))
    parts = {p["partition"]: p for p in result["partitions"]}
    mma = parts["mma"]["waits"][0]
    assert mma["next"] == "HGMMA" and mma["samples"] / result["total_samples"] == pytest.approx(0.105, abs=1e-3)
    assert parts["idle"]["share_of_all"] == pytest.approx(0.121, abs=1e-3)


def test_a_file_that_is_not_a_sass_page_is_named(tmp_path, capsys):
    other = tmp_path / "details.txt"
    other.write_text("Section: GPU Speed Of Light\n")
    with pytest.raises(SystemExit, match="no 'Address,Source' header"):
        ncu_stalls.main([str(other)])
    no_samples = tmp_path / "x.csv"
    no_samples.write_text('"Address","Source","# Samples"\n"0x10","NOP","1"\n')
    with pytest.raises(SystemExit, match="no 'Warp Stall Sampling"):
        ncu_stalls.main([str(no_samples)])
    with pytest.raises(SystemExit, match="no such file"):
        ncu_stalls.main([str(tmp_path / "missing.csv.gz")])


def test_the_report_prints_each_partition_and_its_waits(capsys):
    assert ncu_stalls.main([str(CALL6 / "ws_bf16_sass.csv.gz")]) == 0
    out = capsys.readouterr().out
    assert "mma" in out and "waits on mbarrier 0x35150 (then HGMMA" in out and "64.0% of this partition" in out
