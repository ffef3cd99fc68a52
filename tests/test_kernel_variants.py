"""The GPU scripts' command lines (kernel_variants tile configs, tuner_stability cases, graph_ab arms, loss_bench, eager_probe) and offline_sass's sm_90 instruction count: bad input fails in one line before any GPU work."""
import os
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


def test_tuner_stability_refuses_a_bad_case_in_one_line(monkeypatch):
    import tuner_stability
    monkeypatch.setattr(tuner_stability.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(sys, "argv", ["tuner_stability.py", "--out", "/tmp/unused", "gate:512"])
    with pytest.raises(SystemExit) as raised:
        tuner_stability.main()
    assert "cannot read case 'gate:512'" in str(raised.value) and "\n" not in str(raised.value)


@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="tuning times kernels on a CUDA GPU")
def test_tuner_stability_tunes_again_on_every_call():
    """Each repeat must really re-tune (no cached pick or launch plan), in both arms."""
    import torch
    import tuner_stability
    from forge_core.kernels import fused as fused_module
    from forge_core.rules import get_rule
    from forge_core.state import ParamState

    weight = (torch.randn(192, 256, device="cuda") * 0.02).bfloat16()
    sample = (torch.randn(96, 256, device="cuda").bfloat16(), torch.randn(96, 192, device="cuda").bfloat16() * 0.01,
              weight, ParamState(weight, get_rule("adamw"), "int8"))
    calls = []
    original = fused_module.tune_config

    def counting(*args, **kwargs):
        calls.append(kwargs.get("finalists"))
        return original(*args, **kwargs)

    fused_module.tune_config = counting
    try:
        for finalists in (1, fused_module.FINALISTS, 1):
            config, seconds = tuner_stability.tune_once(sample, finalists)
            assert isinstance(config, TileConfig) and seconds > 0
    finally:
        fused_module.tune_config = original
        fused_module.FINALISTS = tuner_stability.ARMS["finals"]
    assert calls == [1, fused_module.FINALISTS, 1]


def test_graph_ab_reads_arm_specs_before_building_anything():
    import graph_ab
    assert graph_ab.parse_arm("tuned") == ("tuned", None, None)
    kind, shapes, config = graph_ab.parse_arm("pin:14336x4096,4096x14336=64x128x64/w8/s4/sp2/r128")
    assert kind == "pin" and shapes == {(14336, 4096), (4096, 14336)}
    assert config == TileConfig(64, 128, 64, 8, 8, 4, prefetch=True, split_n=2, max_registers=128)
    assert graph_ab.parse_arm("sms:120") == ("sms", None, 120)


@pytest.mark.parametrize("spec,message", [
    ("fast", "unknown arm 'fast'"),
    ("pin:14336x4096", "unknown arm"),
    ("pin:14336=64x128x64/w8/s4", "cannot read the weight shapes"),
    ("pin:axb=64x128x64/w8/s4", "cannot read the weight shapes"),
    ("pin:14336x4096=64x128/w8/s4", "cannot read tile config"),
    ("sms:0", "needs a program count >= 1"),
    ("sms:all", "needs a program count >= 1"),
])
def test_graph_ab_refuses_a_bad_arm_in_one_line(spec, message, monkeypatch):
    import graph_ab
    monkeypatch.setattr(sys, "argv", ["graph_ab.py", "--out", "/tmp/unused.jsonl", "--method", "forge_int8", "tuned", spec])
    with pytest.raises(SystemExit) as raised:
        graph_ab.main()
    assert message in str(raised.value) and "\n" not in str(raised.value)


def test_graph_ab_summary_skips_rounds_without_energy():
    import graph_ab
    rounds = [{"ms": 82.0, "energy_j_per_step": 58.0}, {"ms": 84.0}, {"ms": 83.0, "energy_j_per_step": 55.0}]
    assert graph_ab.median_of(rounds, "ms") == 83.0
    assert graph_ab.median_of(rounds, "energy_j_per_step") == 56.5
    assert graph_ab.median_of([{"ms": 1.0}], "power_w_mean") is None


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks the error on a machine without a GPU")
def test_loss_bench_says_it_needs_a_gpu(monkeypatch, tmp_path):
    import loss_bench
    monkeypatch.setattr(sys, "argv", ["loss_bench.py", "--out", str(tmp_path / "out.json")])
    with pytest.raises(SystemExit) as raised:
        loss_bench.main()
    assert str(raised.value) == "loss_bench: needs a CUDA GPU"
    assert not (tmp_path / "out.json").exists()


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks the error on a machine without a GPU")
def test_eager_probe_says_it_needs_a_gpu(tmp_path, capsys):
    import eager_probe
    assert eager_probe.main(["--out", str(tmp_path / "probe.json")]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "eager_probe: needs a CUDA device (torch.cuda.is_available() is False)"
    assert not (tmp_path / "probe.json").exists()


def test_eager_probe_rejects_an_unknown_option(capsys):
    import eager_probe
    with pytest.raises(SystemExit) as raised:
        eager_probe.main(["--out", "x.json", "--bogus"])
    assert raised.value.code == 2 and "--bogus" in capsys.readouterr().err


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks the error on a machine without a GPU")
def test_host_cost_says_it_needs_a_gpu(tmp_path, capsys, monkeypatch):
    import host_cost
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert host_cost.main(["--out", str(tmp_path / "cost.json")]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "host_cost: needs a CUDA device (or TRITON_INTERPRET=1 for a smoke run on the CPU)"
    assert not (tmp_path / "cost.json").exists()


@pytest.mark.skipif(__import__("torch").cuda.is_available() or os.environ.get("TRITON_INTERPRET") != "1",
                    reason="the CPU smoke run needs the Triton interpreter (TRITON_INTERPRET=1 at import)")
def test_host_cost_pairs_two_trees_in_one_process(tmp_path, monkeypatch):
    """A smoke run on the CPU: every arm of both trees is timed in each round and the paired
    difference is reported (here the tree against itself, imported a second time)."""
    import json

    import host_cost
    from forge_core import linear
    from forge_core.kernels import fused

    for module, name in ((fused, "_tuned_config"), (linear, "run_beside")):
        monkeypatch.setattr(module, name, getattr(module, name))      # restored after the test
    root = Path(__file__).resolve().parents[1]
    out = tmp_path / "cost.json"
    assert host_cost.main(["--depth", "2", "--width", "32", "--tokens", "8", "--rounds", "2", "--calls", "1",
                           "--against", str(root), "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    for arm in ("native", "forge", "forge_inline", "forge@against", "forge_inline@against"):
        assert len(result["all"][f"backward_us_per_layer/{arm}"]) == 2, arm
    assert "this_minus_against_us/forge" in result["medians"]
    assert result["against"] == str(root)
    sys.modules.pop("forge_core_against", None)


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
