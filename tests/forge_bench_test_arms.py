"""Misbehaving arms for the harness tests, loaded through FORGE_BENCH_PLUGINS.

Each one breaks in one way a real arm can: it crashes, hangs, runs out of memory (always, or
only on its first attempt), diverges, claims AdamW but computes something else, or cannot run
(on any model, or on the model it is given).
"""
from __future__ import annotations

import os
import time
from pathlib import Path

import torch

from forge_bench.methods import METHODS, Method, TorchArm, causal_lm_parts, register

OOM_FLAG_ENV = "FORGE_BENCH_TEST_OOM_FLAG"   # a file path: the first OOM-once attempt creates it


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
    Method("test_crash", "baseline", "raises inside step", lambda m, c: _CrashArm(m, None, {})),
    Method("test_hang", "baseline", "sleeps forever inside step", lambda m, c: _HangArm(m, None, {})),
    Method("test_oom_always", "baseline", "simulated CUDA OOM on every attempt",
           lambda m, c: _OomArm(m, None, {}, once=False)),
    Method("test_oom_once", "baseline", "simulated CUDA OOM on the first attempt only",
           lambda m, c: _OomArm(m, _sgd(m, c), {}, once=True)),
    Method("test_diverge", "baseline", "returns a NaN loss", lambda m, c: _DivergeArm(m, _sgd(m, c), {})),
    Method("test_wrong_adamw", "baseline", "AdamW at 30x lr claiming AdamW parity", _wrong_adamw,
           parity_reference="adamw"),
    Method("test_unavailable", "baseline", "never available", lambda m, c: TorchArm(m, None, {}),
           extra_check=lambda: "test_unavailable: needs hardware that does not exist"),
    Method("test_no_lm_head", "baseline", "a build that finds no separable LM head (as the chunked-loss arms)",
           lambda m, c: causal_lm_parts(torch.nn.Sequential())),
    Method("test_forge_like", "forge", "plain SGD registered as a FORGE-family arm (for --check tests)",
           lambda m, c: TorchArm(m, _sgd(m, c), {})),
]
for _method in _ENTRIES:
    if _method.name not in METHODS:
        register(_method)
