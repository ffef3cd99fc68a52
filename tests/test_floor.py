"""The floor's arithmetic (the GPU measurements themselves run in the sweep on CUDA)."""
import pytest
import torch
from torch import nn

from forge_bench.floor import floor_ms, fused_linear_shapes, state_traffic_bytes

LLAMA8B_LAYER = [(4096, 4096), (1024, 4096), (1024, 4096), (4096, 4096), (14336, 4096), (14336, 4096), (4096, 14336)]
LLAMA8B = LLAMA8B_LAYER * 32 + [(128256, 4096)]


def test_llama8b_traffic_matches_the_issue_figures():
    # issue 6: at 3.018 TB/s copy, 29.9 ms (bf16 states) and 20.6 ms (int8) of traffic
    bw = 3.018e12
    assert state_traffic_bytes(LLAMA8B, 2, "bf16") / bw * 1e3 == pytest.approx(29.84, abs=0.01)
    assert state_traffic_bytes(LLAMA8B, 2, "int8") / bw * 1e3 == pytest.approx(20.51, abs=0.01)
    # per element: bf16 W r+w (4 B) + 2 moments r+w (8 B) = 12 B
    assert state_traffic_bytes([(10, 10)], 2, "bf16") == 100 * 12
    assert state_traffic_bytes([(10, 64)], 4, "fp32") == 640 * (8 + 16)
    assert state_traffic_bytes([(1, 64)], 2, "int8") == pytest.approx(64 * (4 + 2 * (2 + 8 / 64)))


def test_unknown_state_dtype_is_named():
    with pytest.raises(ValueError, match="state_dtype 'fp8'"):
        state_traffic_bytes([(1, 1)], 2, "fp8")


def test_shapes_skip_tied_and_frozen_weights():
    emb = nn.Embedding(11, 8)
    head = nn.Linear(8, 11, bias=False)
    head.weight = emb.weight  # tied
    frozen = nn.Linear(8, 8)
    frozen.weight.requires_grad_(False)
    model = nn.ModuleDict({"emb": emb, "up": nn.Linear(8, 32), "down": nn.Linear(32, 8), "head": head, "frozen": frozen})
    assert sorted(fused_linear_shapes(model)) == [(8, 32), (32, 8)]


def test_floor_formula():
    terms = {"wgrad_ms": 14.6, "traffic_ms": {"bf16": 29.9, "int8": 20.6, "fp32": 50.0}}
    assert floor_ms(120.0, terms, "bf16") == pytest.approx(120.0 - 14.6 + 29.9)
    terms_gemm_bound = {"wgrad_ms": 40.0, "traffic_ms": {"bf16": 29.9}}
    assert floor_ms(120.0, terms_gemm_bound, "bf16") == pytest.approx(120.0)
