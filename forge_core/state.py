"""Optimizer-state storage for one fused weight: fp32, bf16, int8 or fp8 (+ per-block fp32 scales).

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
* A denominator kept as it is (the rule's ``floored_states``: Adamax's ``exp_inf``, ``max(beta2 * u,
  |g| + eps)``) is quantized as it is, and its codes are floored at 1 as a second moment's are: a
  dequantized ``u`` is at least ``absmax / 127`` next to a non-zero block maximum. Why: a value below
  half a code (``absmax / 254``: an element whose gradients were small next to the block's large
  ones) would decode to 0, and the next step without a gradient there divides the element's first
  moment by ``eps`` (Adamax moved a tiny Llama's embedding by 2.7e4 lr in one step). Floored, the
  ratio ``m / u`` stays at most about 1.5 (``m`` is at most ``u`` before rounding), as torch's does
  at 1.

fp8 format (``"fp8"``): the int8 format's blocks, scales and sqrt domain with float8_e4m3fn codes
(4 exponent bits, 3 mantissa bits, largest finite 448):

* ``scale = absmax / 448`` per block (fp32, the same shape as int8's), re-quantized every step.
* Code ``q = fp8(y * (1 / scale))``: the product rounded to fp32, then to the nearest e4m3fn value
  with ties to even, as torch's ``.to(torch.float8_e4m3fn)`` (``|y| * (1 / scale) <= 448`` up to
  the product's rounding, which rounds to 448). A block whose scale is 0 or subnormal multiplies by 1
  (its values round to code 0). Codes of a sqrt-domain or floored state are floored at the smallest
  positive code (2^-9) where the block's scale is normal, as int8's are at 1: a dequantized second
  moment is at least ``(absmax / 448 * 2^-9)**2`` next to a non-zero block maximum.
* Decoding is exact: ``q * scale`` in fp32 (squared for sqrt-domain states).
* The fp8 grid is relative (3 mantissa bits: half an ulp is 1/16 of the value) where int8's is
  absolute (half a code is 1/254 of the block maximum): fp8 keeps small values of a block that int8
  rounds to zero, and rounds large ones more coarsely. On the GPU the scale is absmax times
  fp32(1 / 448) and the reciprocal the hardware one, so a code can differ by one next to a tie.

fp32 states are stored as is; bf16 states are rounded to nearest-even on every store.
"""
from __future__ import annotations

from typing import Any, Callable, Mapping

import torch

from .rules.base import Rule

STATE_DTYPES = ("fp32", "bf16", "int8", "fp8")
QBLOCK = 64
BLOCK_SCALED = ("int8", "fp8")
"""The state formats stored as codes with one fp32 scale per ``QBLOCK`` elements of a row."""
FP8_MAX = 448.0
"""The largest finite float8_e4m3fn value: an fp8 block's scale is its absmax over this."""
_STORAGE_DTYPE = {"fp32": torch.float32, "bf16": torch.bfloat16, "int8": torch.int8, "fp8": torch.float8_e4m3fn}
_SMALLEST_FP8_CODE = 2.0 ** -9         # the smallest positive float8_e4m3fn value (subnormal, bits 0x01)
CODES_AS_IS, CODES_SQRT, CODES_FLOORED = 0, 1, 2
"""A state's code domain as the kernels take it (``ParamState.code_domain``): coded as it is; in the sqrt
domain (codes floored); as it is with floored codes (the rule's ``floored_states``)."""


Allocate = Callable[[tuple[int, ...], torch.dtype, torch.device], torch.Tensor]
"""Where a ``ParamState``'s tensors go: a zeroed tensor of (shape, dtype, device)."""


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.zeros(shape, dtype=dtype, device=device)


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


def quantize_blockwise(x32: torch.Tensor, sqrt_domain: bool, codes: str = "int8",
                       floored: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 ``x32`` (..., D) -> (codes of x32's shape, fp32 scales (..., ceil(D/64))); ``codes``: "int8"
    (int8 codes) or "fp8" (float8_e4m3fn codes); ``floored``: codes floored at the smallest positive one
    where the block's scale is normal (None: as ``sqrt_domain``; a floored state is non-negative).

    See the module docstring for the exact rules; the fused kernel implements the same ones."""
    if codes not in BLOCK_SCALED:
        raise ValueError(f"quantize_blockwise: codes must be one of {BLOCK_SCALED}, got {codes!r}")
    if x32.dim() < 1 or x32.shape[-1] == 0:
        raise ValueError(f"quantize_blockwise: need a non-empty last dimension, got shape {tuple(x32.shape)}")
    values = x32.float()
    floored = sqrt_domain if floored is None else bool(floored)
    if sqrt_domain:
        values = values.clamp_min(0.0).sqrt()
    blocks = _blocked(values)
    code_max = 127.0 if codes == "int8" else FP8_MAX
    scale = blocks.abs().amax(dim=-1) / code_max
    has_scale = scale >= torch.finfo(torch.float32).tiny          # normal: 1 / scale is finite
    inverse = 1.0 / torch.where(has_scale, scale, torch.ones_like(scale))
    scaled = blocks * inverse.unsqueeze(-1)
    if codes == "int8":
        q = torch.round(scaled).clamp_(-127.0, 127.0)     # ties to even
        if floored:
            q = torch.where(has_scale.unsqueeze(-1), q.clamp_min(1.0), q)
        q = q.to(torch.int8)
    else:
        q = scaled.to(torch.float8_e4m3fn).float()         # ties to even; |scaled| <= 448 up to one rounding
        if floored:
            q = torch.where(has_scale.unsqueeze(-1), q.clamp_min(_SMALLEST_FP8_CODE), q)
        q = q.to(torch.float8_e4m3fn)
    q = q.reshape(*values.shape[:-1], -1)[..., : values.shape[-1]]
    return q.contiguous(), scale


def dequantize_blockwise(q: torch.Tensor, scale: torch.Tensor, sqrt_domain: bool) -> torch.Tensor:
    """int8 or float8_e4m3fn codes + fp32 block scales -> fp32 values (squared back for sqrt-domain states)."""
    if q.dtype not in (torch.int8, torch.float8_e4m3fn):
        raise ValueError(f"dequantize_blockwise: codes must be int8 or float8_e4m3fn, got {q.dtype}")
    if scale.shape != (*q.shape[:-1], num_blocks(q.shape[-1])):
        raise ValueError(f"dequantize_blockwise: scale shape {tuple(scale.shape)} does not fit codes {tuple(q.shape)}")
    blocks = _blocked(q.float())
    values = (blocks * scale.float().unsqueeze(-1)).reshape(*q.shape[:-1], -1)[..., : q.shape[-1]]
    if sqrt_domain:
        values = values * values
    return values.contiguous()


class ParamState:
    """The optimizer state of one fused weight, in the chosen storage precision.

    ``values[name]`` has the weight's shape (fp32 / bf16 / int8 / float8_e4m3fn); ``scales[name]`` is
    the int8 / fp8 block-scale tensor ``(Dout, ceil(Din/64))`` (``None`` for fp32 / bf16). The states
    are the rule's ``states_for(hp)`` (``hp`` None: all of ``rule.state_names``), fixed here: SGD
    without momentum holds none. Each starts at the rule's ``initial_value`` (zero, as torch's moments
    start, unless the rule says otherwise: Adagrad's ``initial_accumulator_value``). A regime-2 rule
    also gets ``layer_sums``: its per-layer sums (fp32, scratch the kernels rewrite every step; not
    part of ``state_dict``).
    """

    def __init__(self, weight: torch.Tensor, rule: Rule, state_dtype: str = "fp32",
                 hp: Mapping[str, Any] | None = None, allocate: Allocate | None = None) -> None:
        """``allocate(shape, dtype, device)``: where the values and scales go (zeroed; default their own
        tensors; ``forge_core.state_arena`` hands out views of one buffer), in ``storage_requests``' order."""
        if state_dtype not in STATE_DTYPES:
            raise ValueError(f"state_dtype must be one of {STATE_DTYPES}, got {state_dtype!r}")
        if weight.dim() != 2:
            raise ValueError(f"ParamState needs a 2-D (Dout, Din) weight, got shape {tuple(weight.shape)}")
        self.rule = rule
        self.state_dtype = state_dtype
        self.shape = tuple(weight.shape)
        self.state_names: tuple[str, ...] = rule.states_for(hp)
        """The states this weight holds, in the epilogue's order."""
        requests = iter(self.storage_requests(weight, rule, state_dtype, hp))
        make = allocate or _zeros
        self.values: dict[str, torch.Tensor] = {name: make(*next(requests)) for name in self.state_names}
        self.scales: dict[str, torch.Tensor | None] = {
            name: (make(*next(requests)) if state_dtype in BLOCK_SCALED else None) for name in self.state_names}
        self.layer_sums: torch.Tensor | None = (
            torch.zeros(rule.layer_sums, dtype=torch.float32, device=weight.device) if rule.layer_sums else None)
        for name in self.state_names:
            initial = rule.initial_value(name, hp)
            if initial != 0.0:
                self.store(name, torch.full(self.shape, initial, dtype=torch.float32, device=weight.device))

    @staticmethod
    def storage_requests(weight: torch.Tensor, rule: Rule, state_dtype: str,
                         hp: Mapping[str, Any] | None = None) -> list[tuple[tuple[int, ...], torch.dtype, torch.device]]:
        """The tensors a ``ParamState`` of ``weight`` allocates, in order: each state's values, then each
        state's int8 / fp8 scales (a ``StateArena`` is planned from them before the states are made)."""
        shape = tuple(weight.shape)
        names = rule.states_for(hp)
        requests = [(shape, _STORAGE_DTYPE[state_dtype], weight.device) for _ in names]
        if state_dtype in BLOCK_SCALED:
            requests += [((shape[0], num_blocks(shape[1])), torch.float32, weight.device) for _ in names]
        return requests

    @property
    def epilogue(self) -> Any:
        """The rule's epilogue for these states (``Rule.epilogue_for``): derived, so a view handed another
        rule (``forge_core.distributed.affine``'s momentum share) runs that rule's epilogue."""
        return self.rule.epilogue_for(self.state_names)

    @property
    def kernel_name(self) -> str:
        """The rule and its state set as a tuning key names them (``Rule.kernel_name``)."""
        return self.rule.kernel_name(self.state_names)

    def is_sqrt_domain(self, name: str) -> bool:
        """Whether ``name`` is stored as sqrt(value) when int8 / fp8 (a second moment)."""
        return name in self.rule.sqrt_domain_states

    def is_floored(self, name: str) -> bool:
        """Whether ``name``'s int8 / fp8 codes are floored at the smallest positive one (a sqrt-domain
        state, or one of the rule's ``floored_states``)."""
        return name in self.rule.sqrt_domain_states or name in self.rule.floored_states

    def code_domain(self, name: str) -> int:
        """How the kernels code ``name`` (their ``S*_SQRT`` constants): ``CODES_AS_IS``, ``CODES_SQRT`` or
        ``CODES_FLOORED``."""
        if self.is_sqrt_domain(name):
            return CODES_SQRT
        return CODES_FLOORED if self.is_floored(name) else CODES_AS_IS

    def _check_name(self, name: str) -> None:
        if name not in self.values:
            raise KeyError(f"rule {self.rule.name!r} has no state {name!r}; states: {list(self.values)}")

    def dequantize(self, name: str) -> torch.Tensor:
        """The state ``name`` as a new fp32 tensor of the weight's shape."""
        self._check_name(name)
        if self.state_dtype in BLOCK_SCALED:
            return dequantize_blockwise(self.values[name], self.scales[name], self.is_sqrt_domain(name))
        return self.values[name].float().clone()

    def store(self, name: str, value32: torch.Tensor) -> None:
        """Write fp32 ``value32`` into state ``name`` (rounded / quantized to the storage dtype)."""
        self._check_name(name)
        if tuple(value32.shape) != self.shape:
            raise ValueError(f"state {name!r} has shape {self.shape}, got a value of shape {tuple(value32.shape)}")
        if self.state_dtype in BLOCK_SCALED:
            codes, scale = quantize_blockwise(value32, self.is_sqrt_domain(name), self.state_dtype,
                                              floored=self.is_floored(name))
            self.values[name].copy_(codes)
            self.scales[name].copy_(scale)
        else:
            self.values[name].copy_(value32)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Plain tensors: ``name`` -> stored values, and ``name + "_scale"`` for int8 / fp8 states."""
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
        view.state_names = self.state_names
        view.layer_sums = self.layer_sums
        view.shape = (stop - start, self.shape[1])
        view.values = {name: value[start:stop] for name, value in self.values.items()}
        view.scales = {name: (scale[start:stop] if scale is not None else None) for name, scale in self.scales.items()}
        return view

    def nbytes(self) -> int:
        """Bytes held by the states, their scales and a regime-2 rule's per-layer sums."""
        total = sum(v.numel() * v.element_size() for v in self.values.values())
        if self.layer_sums is not None:
            total += self.layer_sums.numel() * self.layer_sums.element_size()
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


__all__ = ["STATE_DTYPES", "QBLOCK", "BLOCK_SCALED", "FP8_MAX", "CODES_AS_IS", "CODES_SQRT", "CODES_FLOORED",
           "ParamState", "quantize_blockwise", "dequantize_blockwise", "num_blocks",
           "restore_entry", "saved_entry"]
