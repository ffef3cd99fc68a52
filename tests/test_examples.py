"""The examples users copy: FORGE inside HF's Trainer and inside a plain torchrun script, each run
for a few steps on a tiny model and checked against the same run with torch's AdamW; the torchrun
script on two gloo ranks (data parallel) against the same global batches in one process."""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import forge_core.backends

pytest.importorskip("transformers")
EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def reference_backend(monkeypatch) -> None:
    """FORGE on the torch reference backend: the examples' wiring is under test, not the kernel
    (tests/test_llama_parity.py pins the kernel to torch's AdamW on the same model)."""
    monkeypatch.setattr(forge_core.backends, "interpreting", lambda: False)


def _rms_rel(ours: torch.nn.Module, theirs: torch.nn.Module) -> float:
    numerator = sum(float((a.detach().double() - b.detach().double()).pow(2).sum())
                    for a, b in zip(ours.parameters(), theirs.parameters()))
    denominator = sum(float(b.detach().double().pow(2).sum()) for b in theirs.parameters())
    return (numerator / denominator) ** 0.5


def test_hf_trainer_with_forge_matches_the_unfused_trainer_run(tmp_path: Path, reference_backend) -> None:
    pytest.importorskip("accelerate")
    example = _load("hf_trainer")
    fused, unfused = example.tiny_llama(), example.tiny_llama()
    history = example.train(fused, steps=3, fused=True, output_dir=str(tmp_path / "fused"))
    reference = example.train(unfused, steps=3, fused=False, output_dir=str(tmp_path / "unfused"))
    losses = [e["loss"] for e in history if "loss" in e]
    assert len(losses) == 3
    assert losses == pytest.approx([e["loss"] for e in reference if "loss" in e], rel=1e-5)
    assert _rms_rel(fused, unfused) < 1e-5
    assert _rms_rel(fused, example.tiny_llama()) > 1e-4          # it trained


def test_hf_trainer_with_torch_compile_trains_as_the_eager_forge_run(tmp_path: Path, reference_backend) -> None:
    """``TrainingArguments(torch_compile=True)``: the Trainer compiles the fused model; the fused layers' compiled
    path (forge_core.traced) trains as the eager one does, the scheduler's lr at every step included."""
    pytest.importorskip("accelerate")
    example = _load("hf_trainer")
    compiled, eager = example.tiny_llama(), example.tiny_llama()
    history = example.train(compiled, steps=3, fused=True, output_dir=str(tmp_path / "compiled"),
                            compile_backend="aot_eager")
    reference = example.train(eager, steps=3, fused=True, output_dir=str(tmp_path / "eager"))
    assert [e["loss"] for e in history if "loss" in e] == pytest.approx([e["loss"] for e in reference if "loss" in e],
                                                                        rel=1e-6)
    assert _rms_rel(compiled, eager) < 1e-6
    assert _rms_rel(compiled, example.tiny_llama()) > 1e-4


def test_torchrun_script_with_forge_matches_the_unfused_run(reference_backend) -> None:
    example = _load("torchrun_train")
    fused = example.main(["--steps", "4"])
    unfused = example.main(["--steps", "4", "--unfused"])
    assert _rms_rel(fused, unfused) < 1e-5
    assert _rms_rel(fused, example.tiny_llama(0, torch.device("cpu"))) > 1e-4


def test_torchrun_launches_the_script_and_a_run_resumes_from_its_checkpoint(tmp_path: Path, capsys,
                                                                          reference_backend) -> None:
    checkpoint = tmp_path / "ck.pt"
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}   # the reference backend
    env["PYTHONPATH"] = os.pathsep.join([str(EXAMPLES.parent), os.environ.get("PYTHONPATH", "")])
    launched = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1",
                               str(EXAMPLES / "torchrun_train.py"), "--batch", "2", "--seq", "8", "--steps", "2",
                               "--save", str(checkpoint)], env=env, capture_output=True, text=True, timeout=300)
    assert launched.returncode == 0, launched.stderr[-2000:]
    assert "step    1" in launched.stdout
    example = _load("torchrun_train")
    capsys.readouterr()
    example.main(["--batch", "2", "--seq", "8", "--steps", "3", "--resume", str(checkpoint)])
    printed = capsys.readouterr().out
    assert "step    2" in printed and "step    0" not in printed


def _launch(tmp_path: Path, nproc: int, *args: str) -> subprocess.CompletedProcess:
    """``torchrun --nproc_per_node=nproc examples/torchrun_train.py ARGS`` on the reference backend."""
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}   # the reference backend
    env["PYTHONPATH"] = os.pathsep.join([str(EXAMPLES.parent), os.environ.get("PYTHONPATH", "")])
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
                           str(EXAMPLES / "torchrun_train.py"), *args], env=env, capture_output=True, text=True,
                          timeout=600, cwd=tmp_path)


def test_torchrun_on_two_gloo_ranks_trains_data_parallel_as_one_process_does(tmp_path: Path, capsys,
                                                                             reference_backend) -> None:
    """Two ranks, each with half of every global batch (fuse_data_parallel): the printed losses and the
    trained weights are the one-process run's on the same batches; rank 0 alone prints and saves."""
    checkpoint = tmp_path / "dp.pt"
    launched = _launch(tmp_path, 2, "--batch", "4", "--seq", "8", "--steps", "3", "--save", str(checkpoint))
    assert launched.returncode == 0, launched.stderr[-3000:]
    lines = [line for line in launched.stdout.splitlines() if line.startswith("step")]
    assert [line.split()[1] for line in lines] == ["0", "2"]         # printed once per step: by rank 0 alone
    example = _load("torchrun_train")
    capsys.readouterr()
    single = example.main(["--batch", "4", "--seq", "8", "--steps", "3"])
    single_lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("step")]
    assert [float(line.split()[3]) for line in lines] == pytest.approx(
        [float(line.split()[3]) for line in single_lines], abs=2e-4)
    ranks = torch.load(checkpoint, weights_only=False)["model"]
    mine = single.state_dict()
    assert ranks.keys() == mine.keys()
    gap = sum(float((ranks[k].double() - mine[k].double()).pow(2).sum()) for k in mine)
    size = sum(float(mine[k].double().pow(2).sum()) for k in mine)
    assert (gap / size) ** 0.5 < 1e-5
    untrained = example.tiny_llama(0, torch.device("cpu")).state_dict()
    moved = sum(float((ranks[k].double() - untrained[k].double()).pow(2).sum()) for k in untrained)
    assert (moved / size) ** 0.5 > 1e-4                                 # it trained


def test_torchrun_refuses_a_batch_that_does_not_split_over_the_ranks(tmp_path: Path) -> None:
    launched = _launch(tmp_path, 2, "--batch", "3", "--steps", "1")
    assert launched.returncode != 0
    assert "torchrun_train.py: --batch 3 does not split over 2 processes" in launched.stderr
