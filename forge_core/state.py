"""Optimizer-state storage for one fused weight: fp32, bf16 or int8 (+ per-block fp32 scales).

int8 format (the spec the fused kernel reproduces exactly):

* Blocks of ``QBLOCK = 64`` consecutive elements along a row (the Din axis) of the
  ``(Dout, Din)`` state; the last block of a row is ragged when ``Din % 64 != 0`` (its missing
  elements count as 0). ``scale = absmax / 127`` per block, stored in fp32 with shape
  ``(Dout, ceil(Din / 64))``.
* Code ``q = round(y * (1 / scale))`` in fp32, to the nearest integer with ties to even (unbiased;
  ``|q| <= 127`` since ``|y| <= absmax``), with one IEEE reciprocal per block. A block whose
  scale is 0 or subnormal (absmax < 1.5e-36, e.g. a first moment decayed by hundreds of zero
  gradients: ``1 / scale`` would overflow) keeps its scale and has all codes 0. The kernel
  computes the same in the CPU interpreter. On the GPU it takes cheaper steps: the scale is
  absmax times fp32(1 / 127) (within one ulp), the reciprocal is the hardware one (<= 2 ulp), the
  product and the rounding are one FMA, a second moment's sqrt is the fast one; so a code can
  differ by one next to a tie, never more.
  Re-quantized from fp32 on every step.
* Second moments (the rule's ``sqrt_domain_states``, e.g. AdamW's ``exp_avg_sq``) are stored in
  the sqrt domain: ``y = sqrt(max(v, 0))`` is quantized and ``v = (q * scale)**2`` on load. This
  halves the dynamic range the 8 bits must cover, and their codes are floored at 1 whenever the
  block's scale is non-zero, so a dequantized ``v`` is never 0 (nor negative, nor inf) next to a
  non-zero block maximum: it is at least ``(absmax / 127)**2``. That over-estimates a tiny ``v``
  (a smaller, safer step) instead of dividing a first moment by ``eps``.

fp32 states are stored as is; bf16 states are rounded to nearest-even on every store.
"""
from __future__ import annotations

from typing import Any, Mapping

import torch

from .rules.base import Rule

STATE_DTYPES = ("fp32", "bf16", "int8")
QBLOCK = 64
_STORAGE_DTYPE = {"fp32": torch.float32, "bf16": torch.bfloat16, "int8": torch.int8}


def num_blocks(length: int) -> int:
    """Number of ``QBLOCK``-wide blocks covering ``length`` elements (the last may be ragged)."""
    return (int(length) + QBLOCK - 1) // QBLOCK


def _blocked(x: torch.Tensor) -> torch.Tensor:
    """View ``x`` (..., D) as (..., ceil(D/64), 64), zero-padding a ragged last block."""
    length = x.shape[-1]
    pad = num_blocks(length) * QBLOCK - length
    if pad:
        x = torch.nn.functional.pad(x, (0, pad))
    return x.reshape(*x.shape[:-1], -1, QBLOCK)


def quantize_blockwise(x32: torch.Tensor, sqrt_domain: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 ``x32`` (..., D) -> (int8 codes of x32's shape, fp32 scales (..., ceil(D/64))).

    See the module docstring for the exact rule; the fused kernel implements the same one."""
    if x32.dim() < 1 or x32.shape[-1] == 0:
        raise ValueError(f"quantize_blockwise: need a non-empty last dimension, got shape {tuple(x32.shape)}")
    values = x32.float()
    if sqrt_domain:
        values = values.clamp_min(0.0).sqrt()
    blocks = _blocked(values)
    scale = blocks.abs().amax(dim=-1) / 127.0
    has_scale = scale >= torch.finfo(torch.float32).tiny          # normal: 1 / scale is finite
    inverse = 1.0 / torch.where(has_scale, scale, torch.ones_like(scale))
    codes = torch.round(blocks * inverse.unsqueeze(-1)).clamp_(-127.0, 127.0)     # ties to even
    if sqrt_domain:
        codes = torch.where(has_scale.unsqueeze(-1), codes.clamp_min(1.0), codes)
    codes = codes.to(torch.int8)
    codes = codes.reshape(*values.shape[:-1], -1)[..., : values.shape[-1]]
    return codes.contiguous(), scale


def dequantize_blockwise(q: torch.Tensor, scale: torch.Tensor, sqrt_domain: bool) -> torch.Tensor:
    """int8 codes + fp32 block scales -> fp32 values (squared back for sqrt-domain states)."""
    if q.dtype != torch.int8:
        raise ValueError(f"dequantize_blockwise: codes must be int8, got {q.dtype}")
    if scale.shape != (*q.shape[:-1], num_blocks(q.shape[-1])):
        raise ValueError(f"dequantize_blockwise: scale shape {tuple(scale.shape)} does not fit codes {tuple(q.shape)}")
    blocks = _blocked(q.float())
    values = (blocks * scale.float().unsqueeze(-1)).reshape(*q.shape[:-1], -1)[..., : q.shape[-1]]
    if sqrt_domain:
        values = values * values
    return values.contiguous()


class ParamState:
    """The optimizer state of one fused weight, in the chosen storage precision.

    ``values[name]`` has the weight's shape (fp32 / bf16 / int8); ``scales[name]`` is the int8
    block-scale tensor ``(Dout, ceil(Din/64))`` (``None`` for fp32 / bf16). All start at zero,
    as torch's optimizers start their moments.
    """

    def __init__(self, weight: torch.Tensor, rule: Rule, state_dtype: str = "fp32") -> None:
        if state_dtype not in STATE_DTYPES:
            raise ValueError(f"state_dtype must be one of {STATE_DTYPES}, got {state_dtype!r}")
        if weight.dim() != 2:
            raise ValueError(f"ParamState needs a 2-D (Dout, Din) weight, got shape {tuple(weight.shape)}")
        self.rule = rule
        self.state_dtype = state_dtype
        self.shape = tuple(weight.shape)
        storage = _STORAGE_DTYPE[state_dtype]
        self.values: dict[str, torch.Tensor] = {
            name: torch.zeros(self.shape, dtype=storage, device=weight.device) for name in rule.state_names}
        self.scales: dict[str, torch.Tensor | None] = {
            name: (torch.zeros((self.shape[0], num_blocks(self.shape[1])), dtype=torch.float32, device=weight.device)
                   if state_dtype == "int8" else None)
            for name in rule.state_names}

    def is_sqrt_domain(self, name: str) -> bool:
        """Whether ``name`` is stored as sqrt(value) when int8 (a second moment)."""
        return name in self.rule.sqrt_domain_states

    def _check_name(self, name: str) -> None:
        if name not in self.values:
            raise KeyError(f"rule {self.rule.name!r} has no state {name!r}; states: {list(self.values)}")

    def dequantize(self, name: str) -> torch.Tensor:
        """The state ``name`` as a new fp32 tensor of the weight's shape."""
        self._check_name(name)
        if self.state_dtype == "int8":
            return dequantize_blockwise(self.values[name], self.scales[name], self.is_sqrt_domain(name))
        return self.values[name].float().clone()

    def store(self, name: str, value32: torch.Tensor) -> None:
        """Write fp32 ``value32`` into state ``name`` (rounded / quantized to the storage dtype)."""
        self._check_name(name)
        if tuple(value32.shape) != self.shape:
            raise ValueError(f"state {name!r} has shape {self.shape}, got a value of shape {tuple(value32.shape)}")
        if self.state_dtype == "int8":
            codes, scale = quantize_blockwise(value32, self.is_sqrt_domain(name))
            self.values[name].copy_(codes)
            self.scales[name].copy_(scale)
        else:
            self.values[name].copy_(value32)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Plain tensors: ``name`` -> stored values, and ``name + "_scale"`` for int8 states."""
        out: dict[str, torch.Tensor] = {}
        for name, value in self.values.items():
            out[name] = value
            if self.scales[name] is not None:
                out[name + "_scale"] = self.scales[name]
        return out

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Copy tensors saved by ``state_dict`` back in place (same dtype and shapes required)."""
        for name, value in self.values.items():
            self._load_one(name, value, state)
            if self.scales[name] is not None:
                self._load_one(name + "_scale", self.scales[name], state)

    @staticmethod
    def _load_one(key: str, target: torch.Tensor, state: Mapping[str, Any]) -> None:
        if key not in state:
            raise KeyError(f"state dict lacks {key!r}")
        source = state[key]
        if not isinstance(source, torch.Tensor) or source.shape != target.shape or source.dtype != target.dtype:
            got = (tuple(source.shape), source.dtype) if isinstance(source, torch.Tensor) else type(source).__name__
            raise ValueError(f"state {key!r}: expected {tuple(target.shape)} {target.dtype}, got {got}")
        target.copy_(source)

    def rows(self, start: int, stop: int) -> "ParamState":
        """A ParamState viewing rows ``[start, stop)`` of this one (no copy).

        Why: an update of a row block of the weight (a vocab chunk of an LM head) needs the block's
        moments and int8 scales. States are ``(Dout, Din)`` contiguous and int8 blocks run along a
        row, so a row slice is a contiguous view holding whole blocks; writes through the view land
        in this state. ``load_state_dict`` copies in place, so a view stays valid across a load."""
        start, stop = int(start), int(stop)
        if not 0 <= start < stop <= self.shape[0]:
            raise ValueError(f"rows [{start}, {stop}) are not a non-empty range of the {self.shape[0]} rows")
        view = ParamState.__new__(ParamState)
        view.rule = self.rule
        view.state_dtype = self.state_dtype
        view.shape = (stop - start, self.shape[1])
        view.values = {name: value[start:stop] for name, value in self.values.items()}
        view.scales = {name: (scale[start:stop] if scale is not None else None) for name, scale in self.scales.items()}
        return view

    def nbytes(self) -> int:
        """Bytes held by the states and their scales."""
        total = sum(v.numel() * v.element_size() for v in self.values.values())
        total += sum(s.numel() * s.element_size() for s in self.scales.values() if s is not None)
        return total


def saved_entry(owner: Any) -> dict[str, Any]:
    """A kernel-stepped weight's entry in an optimizer's ``state_dict()["state"]``: torch's per-parameter
    ``step`` plus its ``ParamState`` tensors (``owner``: anything with ``.state`` and ``.steps_done``)."""
    return {"step": torch.tensor(float(owner.steps_done)), **owner.state.state_dict()}


def restore_entry(owner: Any, entry: Mapping[str, Any]) -> None:
    """Load what ``saved_entry`` saved (ParamState errors pass through)."""
    owner.state.load_state_dict({k: v for k, v in entry.items() if k != "step"})
    owner.steps_done = int(entry["step"])


__all__ = ["STATE_DTYPES", "QBLOCK", "ParamState", "quantize_blockwise", "dequantize_blockwise", "num_blocks",
           "restore_entry", "saved_entry"]
