"""scripts/kernel_variants.py: reading tile configs from the command line (the timing needs a GPU)."""
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

from forge_core.kernels.fused import TileConfig  # noqa: E402
from kernel_variants import parse_config  # noqa: E402


def test_parse_config_reads_every_field():
    assert parse_config("64x64x32/w4/s6/r128") == TileConfig(64, 64, 32, 8, 4, 6, prefetch=True, split_n=1,
                                                               max_registers=128)
    assert parse_config("128x256x64/w8/s3/sp4/g16/nopf") == TileConfig(128, 256, 64, 16, 8, 3, prefetch=False,
                                                                       split_n=4, max_registers=None)
    assert parse_config("64x64x32/w4/s6/r128/ptr") == TileConfig(64, 64, 32, 8, 4, 6, prefetch=True,
                                                                   max_registers=128, tma=False)


@pytest.mark.parametrize("spec,message", [
    ("64x64/w4/s6", "cannot read tile config '64x64/w4/s6'"),
    ("64x64x32//w4/s6", "cannot read tile config"),
    ("64x64x32/w4/s6/", "cannot read tile config"),
    ("64x64x32/q4/s6", "cannot read tile config"),
    ("64x64x32/w4", "needs /wWARPS and /sSTAGES"),
])
def test_parse_config_refuses_bad_specs_in_one_line(spec, message):
    with pytest.raises(SystemExit) as raised:
        parse_config(spec)
    assert message in str(raised.value) and "\n" not in str(raised.value)
