"""The eager fused Linear's C++ backward hook (``forge_core.native_hooks``): it replays recorded updates
without Python and hands everything else to the Python update, so training through it equals training
through the Python hook bit for bit. On the CPU a recording that re-runs the update stands in for the CUDA
graph (``test_update_graphs.Rerun``); the layers read fixed input and gradient tensors (roots of the
backward), which is what a graph's fixed addresses hold."""
from __future__ import annotations

import gc
import weakref

import pytest
import torch
from torch import nn

import forge_core
from forge_core import native_hooks
from forge_core.kernels import launch_paths, reset_launch_paths
from forge_core.update_graphs import UpdateGraphs
from forge_core.kernels import launch_path_counts

from test_update_graphs import HP, rerun_recorder

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_extension = pytest.mark.skipif(native_hooks.load() is None, reason=f"no C++ hook: {native_hooks.problem()}")
WIDTH, LAYERS = 40, 3


def _layers(seed: int = 0) -> nn.ModuleList:
    torch.manual_seed(seed)
    return nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)).to(DEVICE, torch.bfloat16)


def _fuse(layers: nn.ModuleList, native: bool) -> forge_core.ForgeOptimizer:
    probe = torch.zeros(2, WIDTH, device=DEVICE, dtype=torch.bfloat16)
    model = nn.Sequential(*layers)
    opt = forge_core.fuse(model, "adamw", backend="triton", probe_inputs=probe, **HP)
    if DEVICE == "cpu":
        for binding in opt.fused_weights():
            binding.update_graphs = UpdateGraphs(launch_path_counts(), rerun_recorder)
    if native:
        assert opt.attach_native_hooks() or DEVICE == "cuda"
        assert all(b.native_slot is not None for b in opt.fused_weights())
    else:
        for binding in opt.fused_weights():
            binding.native_slot = None
            binding.update_graphs.native = None
    return opt


def _static_roots() -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    inputs = [torch.zeros(6, WIDTH, device=DEVICE, dtype=torch.bfloat16, requires_grad=True) for _ in range(LAYERS)]
    grads = [torch.zeros(6, WIDTH, device=DEVICE, dtype=torch.bfloat16) for _ in range(LAYERS)]
    return inputs, grads


def _backward(layers: nn.ModuleList, inputs: list[torch.Tensor], grads: list[torch.Tensor]) -> None:
    outputs = [layer(x) for layer, x in zip(layers, inputs)]
    torch.autograd.backward(outputs, grads)
    for x in inputs:
        x.grad = None


@needs_extension
def test_the_cpp_hook_trains_as_the_python_hook_under_an_lr_schedule(monkeypatch: pytest.MonkeyPatch) -> None:
    """Step 1 launches, step 2 records, steps 3-6 replay: the first replay of each step through Python (it
    brings the device scalars up to date and opens the gate), the others from C++; the weights, moments and
    step counts equal the Python hook's under a cosine schedule."""
    native_layers, python_layers = _layers(), _layers()
    native, python = _fuse(native_layers, native=True), _fuse(python_layers, native=False)
    schedules = [torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=6) for opt in (native, python)]
    inputs, grads = _static_roots()
    generator = torch.Generator().manual_seed(5)
    reset_launch_paths()
    for _ in range(6):
        for tensor in (*inputs, *grads):
            with torch.no_grad():
                tensor.copy_(torch.randn(tensor.shape, generator=generator))
        for layers, opt, schedule in zip((native_layers, python_layers), (native, python), schedules):
            _backward(layers, inputs, grads)
            opt.step()
            schedule.step()
    assert native_hooks.native_replays() == 4 * (LAYERS - 1)
    assert launch_paths()["graph"] == 5 * LAYERS * 2        # both optimizers record at step 2, replay after
    for a, b in zip(native.fused_weights(), python.fused_weights()):
        assert torch.equal(a.matrix, b.matrix), a.name
        assert a.steps_done == b.steps_done == 6
        for name in a.state.state_names:
            assert torch.equal(a.state.values[name], b.state.values[name]), (a.name, name)


@needs_extension
def test_a_second_backward_before_step_is_refused_by_the_python_update() -> None:
    layers = _layers()
    opt = _fuse(layers, native=True)
    inputs, grads = _static_roots()
    for _ in range(3):
        _backward(layers, inputs, grads)
        opt.step()
    assert native_hooks.native_replays() > 0
    with pytest.raises(RuntimeError, match="received backward number 2 since the last opt.step"):
        _backward(layers, inputs, grads)
        _backward(layers, inputs, grads)


@needs_extension
def test_a_graph_run_backward_twice_is_refused_in_one_line() -> None:
    layers = _layers()
    _fuse(layers, native=True)
    x = torch.randn(4, WIDTH, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
    output = layers[0](x)
    output.sum().backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="run backward twice"):
        output.sum().backward()


@needs_extension
def test_a_replay_needs_its_inputs_where_they_lay() -> None:
    """A new input tensor (another address) or another layout goes through Python: recorded again there."""
    layers = _layers()
    opt = _fuse(layers, native=True)
    inputs, grads = _static_roots()
    for _ in range(3):
        _backward(layers, inputs, grads)
        opt.step()
    before = native_hooks.native_replays()
    moved = [torch.zeros_like(x, requires_grad=True) for x in inputs]
    _backward(layers, moved, grads)
    opt.step()
    assert native_hooks.native_replays() == before


@needs_extension
def test_load_state_dict_closes_the_gate_and_drops_the_native_recordings() -> None:
    layers = _layers()
    opt = _fuse(layers, native=True)
    inputs, grads = _static_roots()
    for _ in range(3):
        _backward(layers, inputs, grads)
        opt.step()
    assert all(len(b.native_slot) == 1 for b in opt.fused_weights())
    opt.load_state_dict(opt.state_dict())
    assert all(len(b.native_slot) == 0 and b.micro_batches == 0 for b in opt.fused_weights())


@needs_extension
def test_an_optimizer_with_cpp_hooks_is_collected_when_dropped() -> None:
    """The slot holds its weight's update weakly: no cycle through C++ keeps the optimizer's states alive."""
    layers = _layers()
    opt = _fuse(layers, native=True)
    inputs, grads = _static_roots()
    for _ in range(3):
        _backward(layers, inputs, grads)
        opt.step()
    watched = weakref.ref(opt)
    forge_core.unfuse(nn.Sequential(*layers))
    del opt
    gc.collect()
    assert watched() is None


def test_a_missing_compiler_leaves_the_python_hook_with_one_warning(monkeypatch: pytest.MonkeyPatch) -> None:
    from torch.utils import cpp_extension

    def no_compiler(*args, **kwargs):
        raise RuntimeError("Ninja is required to load C++ extensions\nmore detail")

    monkeypatch.setattr(native_hooks, "_extension", None)
    monkeypatch.setattr(native_hooks, "_problem", None)
    monkeypatch.setattr(native_hooks, "NATIVE_HOOKS", True)
    monkeypatch.setattr(cpp_extension, "load", no_compiler)
    with pytest.warns(RuntimeWarning, match=r"^FORGE: the C\+\+ update hook could not be built or loaded "
                                            r"\(RuntimeError: Ninja is required to load C\+\+ extensions\); "
                                            r"eager fused updates use the Python hook$"):
        assert native_hooks.load() is None
    assert native_hooks.new_gate() is None
    layers = _layers()
    opt = _fuse(layers, native=False)
    assert not opt.attach_native_hooks()


def test_only_cuda_weights_want_the_cpp_hook_unless_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    assert native_hooks.wanted({torch.device("cuda", 0)}) == native_hooks.NATIVE_HOOKS
    assert not native_hooks.wanted({torch.device("cpu")}) and not native_hooks.wanted(set())
    monkeypatch.setattr(native_hooks, "ON_CPU_TOO", True)
    assert native_hooks.wanted({torch.device("cpu")}) == native_hooks.NATIVE_HOOKS
    monkeypatch.setattr(native_hooks, "NATIVE_HOOKS", False)
    assert not native_hooks.wanted({torch.device("cuda", 0)})
