"""Fused updates on a side CUDA stream (``fuse(..., overlap=True)``): the same weights as
updates in line, available as soon as ``backward()`` returns, also inside a captured CUDA graph."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import forge_core
from forge_core.linear import ForgeLinear

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
HP = {"lr": 1e-2, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="the side stream exists on CUDA only")


def _deep_mlp(seed: int = 0, width: int = 96, depth: int = 6, dtype: torch.dtype = torch.float32) -> nn.Sequential:
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.GELU()]
    return nn.Sequential(*layers, nn.LayerNorm(width)).to(DEVICE, dtype)


def _batches(count: int, width: int = 96, dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(11)
    return [torch.randn(3, 40, width, generator=generator).to(DEVICE, dtype) for _ in range(count)]


def _fuse(model: nn.Module, width: int = 96, **kwargs) -> forge_core.ForgeOptimizer:
    probe = torch.zeros(2, width, device=DEVICE, dtype=next(model.parameters()).dtype)
    return forge_core.fuse(model, "adamw", backend="triton", probe_inputs=probe, **HP, **kwargs)


def _backward(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    loss = (model(batch).float() - batch.float()).square().mean()
    loss.backward()
    return loss.detach()


def _step_all(*optimizers: torch.optim.Optimizer) -> None:
    for opt in optimizers:
        opt.step()
        opt.zero_grad(set_to_none=True)


def _assert_same_parameters(a: nn.Module, b: nn.Module) -> None:
    for (name, x), y in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(x, y), name


def test_fuse_records_the_choice_on_every_fused_weight() -> None:
    for overlap in (True, False):
        model = _deep_mlp(depth=2)
        _fuse(model, overlap=overlap)
        updaters = [m.forge_updater for m in model.modules() if isinstance(m, ForgeLinear)]
        assert len(updaters) == 2 and all(u.overlap_updates is overlap for u in updaters)


def test_overlap_on_a_cpu_model_runs_in_line_with_the_same_result() -> None:
    """Off CUDA there is no side stream: overlap=True must change nothing."""
    if torch.cuda.is_available():
        pytest.skip("the CPU path (a CUDA machine runs the CUDA tests below)")
    overlapped, inline = _deep_mlp(depth=2), _deep_mlp(depth=2)
    opt_a, opt_b = _fuse(overlapped, overlap=True), _fuse(inline, overlap=False)
    for batch in _batches(2):
        _backward(overlapped, batch)
        _backward(inline, batch)
        _step_all(opt_a, opt_b)
    _assert_same_parameters(overlapped, inline)


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_overlapped_updates_equal_inline_updates_and_are_done_when_backward_returns(dtype: torch.dtype) -> None:
    """Same kernels in the same per-weight order: bit-identical weights after every backward (read
    right after ``backward()``, before ``step()``: the join at the backward's end must hold)."""
    overlapped, inline = _deep_mlp(dtype=dtype), _deep_mlp(dtype=dtype)
    opt_a, opt_b = _fuse(overlapped, overlap=True), _fuse(inline, overlap=False)
    for batch in _batches(5, dtype=dtype):
        loss_a = _backward(overlapped, batch)
        loss_b = _backward(inline, batch)
        assert torch.equal(loss_a, loss_b)
        for (name, a), b in zip(overlapped.named_parameters(), inline.parameters()):
            if isinstance(dict(overlapped.named_modules())[name.rsplit(".", 1)[0]], ForgeLinear) \
                    and name.endswith("weight"):
                assert torch.equal(a, b), name
        _step_all(opt_a, opt_b)
    _assert_same_parameters(overlapped, inline)


@needs_cuda
def test_activations_are_not_reused_while_the_side_stream_reads_them() -> None:
    """Wide layers and few tokens: each update (W and moments streamed) takes far longer than the
    layer's backward, so the side stream lags and the main stream's later gradients are allocated
    while earlier layers' x and dY are still being read. Without record_stream they would land on
    those blocks; the weights must still equal in-line updates bit for bit."""
    width = 2048
    overlapped, inline = _deep_mlp(width=width, depth=6), _deep_mlp(width=width, depth=6)
    opt_a, opt_b = _fuse(overlapped, width=width, overlap=True), _fuse(inline, width=width, overlap=False)
    generator = torch.Generator().manual_seed(3)
    for _ in range(3):
        batch = torch.randn(2, 16, width, generator=generator).to(DEVICE)
        _backward(overlapped, batch)
        _backward(inline, batch)
        _step_all(opt_a, opt_b)
    _assert_same_parameters(overlapped, inline)


@needs_cuda
def test_a_captured_overlapped_step_replays_like_inline_eager_steps() -> None:
    """The fork and the join are captured as graph edges: replays equal eager in-line steps."""
    eager, graphed = _deep_mlp(), _deep_mlp()
    eager_opt = _fuse(eager, overlap=False, capturable=True)
    graph_opt = _fuse(graphed, overlap=True, capturable=True)
    batches = _batches(7)

    def step(model, opt, batch):
        loss = _backward(model, batch)
        _step_all(opt)
        return loss

    for batch in batches[:3]:
        step(eager, eager_opt, batch)
    capture_stream = torch.cuda.Stream()
    capture_stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(capture_stream):
        for batch in batches[:3]:
            step(graphed, graph_opt, batch)
    torch.cuda.current_stream().wait_stream(capture_stream)
    static_batch = batches[3].clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_loss = step(graphed, graph_opt, static_batch)
    graph_losses = []
    for batch in batches[3:]:
        static_batch.copy_(batch)
        graph.replay()
        graph_losses.append(static_loss.clone())
    eager_losses = [step(eager, eager_opt, batch) for batch in batches[3:]]
    torch.cuda.synchronize()
    assert torch.equal(torch.stack(graph_losses), torch.stack(eager_losses))
    _assert_same_parameters(eager, graphed)
