"""The plain-torch fused step: materializes G = dY^T X in fp32, then runs the rule's reference.

This is the spec of ``fused_wgrad_update`` (same signature) and the CPU backend when Triton is
not available. It allocates a weight-shaped fp32 gradient; the Triton kernel never does.
"""
from __future__ import annotations

from typing import Any, Mapping

import torch

from ..state import ParamState

_INPUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_WEIGHT_DTYPES = (torch.bfloat16, torch.float32)


def flatten_tokens(t: torch.Tensor, width: int, what: str) -> torch.Tensor:
    """(..., width) -> (tokens, width) as a view; copies only when no 2-D view exists (strides
    that cannot be merged), which a contiguous or row-sliced activation never has."""
    if t.dim() < 2 or t.shape[-1] != width:
        raise ValueError(f"{what} must have shape (..., {width}), got {tuple(t.shape)}")
    if t.dim() == 2:
        return t
    try:
        return t.view(-1, width)
    except RuntimeError:
        return t.reshape(-1, width)


def check_arguments(x: torch.Tensor, dy: torch.Tensor, weight: torch.Tensor, state: ParamState,
                    grad_accum: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Validate the fused-step arguments; return (x2, dy2) flattened to (BT, Din) / (BT, Dout)."""
    if weight.dim() != 2:
        raise ValueError(f"weight must be 2-D (Dout, Din), got shape {tuple(weight.shape)}")
    if weight.dtype not in _WEIGHT_DTYPES:
        raise ValueError(f"weight dtype must be bf16 or fp32, got {weight.dtype}")
    dout, din = weight.shape
    if x.dtype not in _INPUT_DTYPES or dy.dtype not in _INPUT_DTYPES:
        raise ValueError(f"x / dy dtypes must be bf16, fp16 or fp32, got {x.dtype} / {dy.dtype}")
    if x.dtype != dy.dtype:
        raise ValueError(f"x and dy must share a dtype, got {x.dtype} and {dy.dtype}")
    x2 = flatten_tokens(x, din, "x")
    dy2 = flatten_tokens(dy, dout, "dy")
    if x2.shape[0] != dy2.shape[0]:
        raise ValueError(f"x has {x2.shape[0]} tokens but dy has {dy2.shape[0]}")
    if tuple(state.shape) != (dout, din):
        raise ValueError(f"state shape {state.shape} does not match weight shape {(dout, din)}")
    devices = {t.device for t in (x, dy, weight)}
    if len(devices) != 1:
        raise ValueError(f"x, dy and weight must be on one device, got {sorted(map(str, devices))}")
    if grad_accum is not None:
        # fp32 (a micro-batch accumulator) or bf16 (a dense .grad of a bf16 weight, see DenseWeight)
        if tuple(grad_accum.shape) != (dout, din) or grad_accum.dtype not in _WEIGHT_DTYPES:
            raise ValueError(f"grad_accum must be fp32 or bf16 of shape {(dout, din)}, got {grad_accum.dtype} "
                             f"{tuple(grad_accum.shape)}")
    return x2, dy2


def stochastic_round_to_bf16(value32: torch.Tensor, seed: int) -> torch.Tensor:
    """Round fp32 to bf16 stochastically: add 16 random low bits, then truncate (unbiased)."""
    generator = torch.Generator(device=value32.device)
    generator.manual_seed(int(seed))
    noise = torch.randint(0, 1 << 16, value32.shape, generator=generator, device=value32.device, dtype=torch.int32)
    bits = value32.contiguous().view(torch.int32)
    rounded = (bits + noise) & ~0xFFFF
    rounded = torch.where(torch.isfinite(value32), rounded, bits)
    return rounded.view(torch.float32).to(torch.bfloat16)


def reference_wgrad_update(x: torch.Tensor, dy: torch.Tensor, weight: torch.Tensor, state: ParamState,
                           hp: Mapping[str, Any], step: int, *, grad_accum: torch.Tensor | None = None,
                           stochastic_rounding: bool = False, seed: int = 0) -> None:
    """G = dY^T X (fp32) [+ grad_accum], then ``state.rule.reference`` on fp32 copies of weight
    and states; results stored back in the weight's / states' dtypes (in place)."""
    x2, dy2 = check_arguments(x, dy, weight, state, grad_accum)
    grad32 = dy2.float().t() @ x2.float()
    if grad_accum is not None:
        grad32 += grad_accum
    weight32 = weight.detach().float().clone()
    states32 = {name: state.dequantize(name) for name in state.state_names}
    state.rule.reference(weight32, grad32, states32, hp, int(step))
    for name, value in states32.items():
        state.store(name, value)
    with torch.no_grad():
        if stochastic_rounding and weight.dtype == torch.bfloat16:
            weight.copy_(stochastic_round_to_bf16(weight32, seed))
        else:
            weight.copy_(weight32)
