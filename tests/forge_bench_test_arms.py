"""Misbehaving arms for the harness tests, loaded through FORGE_BENCH_PLUGINS.

Each one breaks in one way a real arm can: it crashes, hangs, runs out of memory (always, or
only on its first attempt), diverges, claims AdamW but computes something else, or cannot run
(on any model, or on the model it is given). One waits at a gate, so that a test acts on a sweep
while a cell is known to be running (work-boxed, whatever the machine's load).
"""
from __future__ import annotations

import os
import time
from pathlib import Path

import torch

from forge_bench.methods import METHODS, Method, register
from forge_bench.torch_arms import TorchArm, causal_lm_parts

OOM_FLAG_ENV = "FORGE_BENCH_TEST_OOM_FLAG"   # a file path: the first OOM-once attempt creates it
GATE_ENV = "FORGE_BENCH_TEST_GATE"           # a file path: the gated arm writes <gate>.waiting, then steps once it exists


class _CrashArm(TorchArm):
    def step(self, batch):
        raise RuntimeError("boom: simulated crash inside the arm")


class _HangArm(TorchArm):
    def step(self, batch):
        time.sleep(3600)
        return super().step(batch)


class _OomArm(TorchArm):
    def __init__(self, model, optimizer, settings, once: bool):
        super().__init__(model, optimizer, settings)
        self.once = once

    def step(self, batch):
        if self.once:
            flag = Path(os.environ[OOM_FLAG_ENV])
            if not flag.exists():
                flag.write_text("first attempt ran out of memory")
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.00 GiB (simulated)")
            return super().step(batch)
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.00 GiB (simulated)")


class _GatedArm(TorchArm):
    def step(self, batch):
        gate = Path(os.environ[GATE_ENV])
        gate.with_name(gate.name + ".waiting").write_text(str(os.getpid()))
        while not gate.exists():
            time.sleep(0.05)
        return super().step(batch)


class _DivergeArm(TorchArm):
    def step(self, batch):
        return super().step(batch) * float("nan")


def _sgd(model, cfg):
    return torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=cfg.lr, momentum=cfg.momentum)


def _wrong_adamw(model, cfg):
    """AdamW with a 30x learning rate: claims the AdamW reference, so the gate must catch it."""
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=cfg.lr * 30, betas=cfg.betas,
                            eps=cfg.eps, weight_decay=cfg.weight_decay)
    return TorchArm(model, opt, {"lr_scale": 30})


_ENTRIES = [
    Method(name="test_crash", family="baseline", description="raises inside step",
           build=lambda m, c: _CrashArm(m, None, {})),
    Method(name="test_hang", family="baseline", description="sleeps forever inside step",
           build=lambda m, c: _HangArm(m, None, {})),
    Method(name="test_oom_always", family="baseline", description="simulated CUDA OOM on every attempt",
           build=lambda m, c: _OomArm(m, None, {}, once=False)),
    Method(name="test_oom_once", family="baseline", description="simulated CUDA OOM on the first attempt only",
           build=lambda m, c: _OomArm(m, _sgd(m, c), {}, once=True)),
    Method(name="test_gated", family="baseline", description="SGD that waits for a gate file before its first step",
           build=lambda m, c: _GatedArm(m, _sgd(m, c), {})),
    Method(name="test_diverge", family="baseline", description="returns a NaN loss",
           build=lambda m, c: _DivergeArm(m, _sgd(m, c), {})),
    Method(name="test_wrong_adamw", family="baseline", description="AdamW at 30x lr claiming AdamW parity",
           build=_wrong_adamw, parity_reference="adamw"),
    Method(name="test_unavailable", family="baseline", description="never available",
           build=lambda m, c: TorchArm(m, None, {}),
           extra_check=lambda: "test_unavailable: needs hardware that does not exist"),
    Method(name="test_no_lm_head", family="baseline",
           description="a build that finds no separable LM head (as the chunked-loss arms)",
           build=lambda m, c: causal_lm_parts(torch.nn.Sequential())),
    Method(name="test_forge_like", family="forge", description="plain SGD registered as a FORGE-family arm (for --check tests)",
           build=lambda m, c: TorchArm(m, _sgd(m, c), {})),
]


class _DistArm(TorchArm):
    """A distributed arm (strategy dp) whose rank 1 misbehaves as ``how`` says; rank 0 steps as SGD."""

    def __init__(self, model, optimizer, how: str):
        super().__init__(model, optimizer, {"strategy": "dp"})
        self.how = how

    def step(self, batch):
        import torch.distributed as dist

        if dist.get_rank() == 1:
            if self.how == "crash":
                raise RuntimeError("boom: simulated crash on rank 1")
            if self.how == "hang":
                time.sleep(3600)
            if self.how == "oom_once":
                flag = Path(os.environ[OOM_FLAG_ENV])
                if not flag.exists():
                    flag.write_text("rank 1 ran out of memory on the first attempt")
                    raise torch.OutOfMemoryError("CUDA out of memory on rank 1 (simulated)")
        return super().step(batch)


_ENTRIES += [
    Method(name=f"test_dist_{how}", family="baseline", description=f"distributed (dp), rank 1: {how}",
           build=lambda m, c, how=how: _DistArm(m, _sgd(m, c), how), strategy="dp")
    for how in ("crash", "hang", "oom_once")
]

for _method in _ENTRIES:
    if _method.name not in METHODS:
        register(_method)
