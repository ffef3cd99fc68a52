"""The eager fused Linear's C++ backward hook (``forge_core.native_hooks``): it replays recorded updates
without Python and hands everything else to the Python update, so training through it equals training
through the Python hook bit for bit. On the CPU a recording that re-runs the update stands in for the CUDA
graph (``test_update_graphs.Rerun``); the layers read fixed input and gradient tensors (roots of the
backward), which is what a graph's fixed addresses hold."""
from __future__ import annotations

import gc
import os
import shutil
import subprocess
import sys
import weakref
from pathlib import Path

import pytest
import torch
from torch import nn

import forge_core
from forge_core import linear as linear_module
from forge_core import native_hooks, update_graphs
from forge_core.linear import native_forward
from forge_core.kernels import launch_path_counts, launch_paths, reset_launch_paths
from forge_core.update_graphs import UpdateGraphs

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
        assert opt.attach_native_hooks()
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


def _random_fill(tensors: list[torch.Tensor], generator: torch.Generator) -> None:
    with torch.no_grad():
        for tensor in tensors:
            tensor.copy_(torch.randn(tensor.shape, generator=generator))


def _assert_trained_alike(a_opt: forge_core.ForgeOptimizer, b_opt: forge_core.ForgeOptimizer, steps: int) -> None:
    """The same weights, moments and step counts, bit for bit."""
    for a, b in zip(a_opt.fused_weights(), b_opt.fused_weights()):
        assert torch.equal(a.matrix, b.matrix), a.name
        assert a.steps_done == b.steps_done == steps
        for name in a.state.state_names:
            assert torch.equal(a.state.values[name], b.state.values[name]), (a.name, name)


def _replaying() -> tuple[nn.ModuleList, forge_core.ForgeOptimizer, list[torch.Tensor], list[torch.Tensor]]:
    """Fused layers on the C++ hook after three steps on fixed roots: launched, recorded, replayed."""
    layers = _layers()
    opt = _fuse(layers, native=True)
    inputs, grads = _static_roots()
    for _ in range(3):
        _backward(layers, inputs, grads)
        opt.step()
    return layers, opt, inputs, grads


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
        _random_fill([*inputs, *grads], generator)
        for layers, opt, schedule in zip((native_layers, python_layers), (native, python), schedules):
            _backward(layers, inputs, grads)
            opt.step()
            schedule.step()
    assert native_hooks.native_replays() == 4 * (LAYERS - 1) and native_hooks.native_replay_seconds() > 0.0
    paths = launch_paths()
    assert paths["graph"] == 5 * LAYERS * 2                 # both optimizers record at step 2, replay after
    assert paths["recorded"] == LAYERS * 2 and paths["native"] == 4 * (LAYERS - 1)
    reset_launch_paths()
    assert native_hooks.native_replays() == 0 and native_hooks.native_replay_seconds() == 0.0
    _assert_trained_alike(native, python, steps=6)


@needs_extension
def test_a_second_backward_before_step_is_refused_by_the_python_update() -> None:
    layers, opt, inputs, grads = _replaying()
    assert native_hooks.native_replays() > 0
    with pytest.raises(RuntimeError, match="received backward number 2 since the last opt.step"):
        _backward(layers, inputs, grads)
        _backward(layers, inputs, grads)


@needs_extension
def test_a_graph_run_backward_twice_is_refused_in_one_line() -> None:
    layers = _layers()
    _fuse(layers, native=True)
    assert native_hooks.status() == "loaded"
    x = torch.randn(4, WIDTH, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
    output = layers[0](x)
    output.sum().backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="run backward twice"):
        output.sum().backward()


@needs_extension
def test_a_replay_needs_its_inputs_where_they_lay(monkeypatch: pytest.MonkeyPatch) -> None:
    """A new input tensor (another address) or another layout goes through Python: recorded again there
    (inputs that are not staged, ``STAGED_BYTES``)."""
    monkeypatch.setattr(update_graphs, "STAGED_BYTES", 0)
    layers, opt, inputs, grads = _replaying()
    before = native_hooks.native_replays()
    moved = [torch.zeros_like(x, requires_grad=True) for x in inputs]
    _backward(layers, moved, grads)
    opt.step()
    assert native_hooks.native_replays() == before


@needs_extension
def test_small_inputs_that_move_every_step_replay_from_cpp_through_staging() -> None:
    """New input tensors at every step: the C++ hook copies them into the staging buffers its recordings read
    and replays all but each step's first update, training as the Python hook does bit for bit."""
    native_layers, python_layers = _layers(), _layers()
    native, python = _fuse(native_layers, native=True), _fuse(python_layers, native=False)
    generator = torch.Generator().manual_seed(8)
    kept = []                                       # alive: every step's inputs lie somewhere new
    for _ in range(6):
        inputs, grads = _static_roots()
        kept.append((inputs, grads))
        _random_fill([*inputs, *grads], generator)
        before = native_hooks.native_replays()
        for layers, opt in zip((native_layers, python_layers), (native, python)):
            _backward(layers, inputs, grads)
            opt.step()
    assert native_hooks.native_replays() - before == LAYERS - 1
    assert sum(b.native_slot.replays for b in native.fused_weights()) == 4 * (LAYERS - 1)
    _assert_trained_alike(native, python, steps=6)


@needs_extension
def test_inputs_that_move_now_and_then_keep_being_recorded_while_cpp_replays_them(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Inputs that are not staged and move to a new place every few steps cost one recording per move, however
    many moves: each recording is replayed by the C++ hook, and those replays count against
    ``RECORDINGS_WITHOUT_REPLAY`` as Python's do."""
    from forge_core.update_graphs import RECORDINGS_WITHOUT_REPLAY
    monkeypatch.setattr(update_graphs, "STAGED_BYTES", 0)
    layers = _layers()
    opt = _fuse(layers, native=True)
    moves = RECORDINGS_WITHOUT_REPLAY + 3
    kept = []                                       # alive: no later move lands where an earlier one lay
    for _ in range(moves):
        inputs, grads = _static_roots()             # new tensors: another address for every layer
        kept.append((inputs, grads))
        for _ in range(3):                          # seen, recorded, replayed from C++
            before = native_hooks.native_replays()
            _backward(layers, inputs, grads)
            opt.step()
        assert native_hooks.native_replays() - before == LAYERS - 1     # all but the step's first update
    assert not any(b.update_graphs.stopped for b in opt.fused_weights())
    assert sum(b.native_slot.replays for b in opt.fused_weights()) == moves * (LAYERS - 1)


@needs_extension
def test_load_state_dict_closes_the_gate_and_drops_the_native_recordings() -> None:
    layers, opt, inputs, grads = _replaying()
    assert all(len(b.native_slot) == 1 for b in opt.fused_weights())
    opt.load_state_dict(opt.state_dict())
    assert all(len(b.native_slot) == 0 and b.micro_batches == 0 for b in opt.fused_weights())


@needs_extension
def test_an_optimizer_with_cpp_hooks_is_collected_when_dropped() -> None:
    """The slot holds its weight's update weakly: no cycle through C++ keeps the optimizer's states alive."""
    layers, opt, inputs, grads = _replaying()
    watched = weakref.ref(opt)
    forge_core.unfuse(nn.Sequential(*layers))
    del opt
    gc.collect()
    assert watched() is None


EXIT_SCRIPT = """
import gc, sys
import torch
import forge_core
from forge_bench.models import build_model
device = sys.argv[1]
shape = {"vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
         "num_key_value_heads": 2, "head_dim": 16}
model = build_model("qwen3-0.6b", "bfloat16", device, num_layers=2, overrides=shape)
ids = torch.randint(0, 512, (1, 24), device=device)
batch = {"input_ids": ids, "labels": ids}
opt = forge_core.fuse(model, "adamw", lr=1e-4, probe_inputs=batch, backend="auto")
for _ in range(5):
    loss = model(**batch).loss
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
del model, opt
gc.collect()
print("trained")
"""


@needs_extension
@pytest.mark.skipif(DEVICE != "cuda", reason="fuse() gives C++ slots to CUDA weights only: on the CPU the script holds none")
def test_a_script_that_drops_its_optimizer_but_not_its_last_loss_exits_cleanly() -> None:
    """A training script that drops its model and optimizer but keeps its last loss (a module global): that
    graph's hooks hold the C++ slots until the interpreter finalizes, when ``Py_IsInitialized()`` is already
    false; the process still exits 0. On the H200 at c245880 such a script aborted there ("dec_ref() is being
    called while the GIL is either not held", "terminate called", exit 134)."""
    done = subprocess.run([sys.executable, "-c", EXIT_SCRIPT, DEVICE], capture_output=True, text=True, timeout=300,
                          cwd=Path(__file__).parent.parent)
    assert done.returncode == 0 and "trained" in done.stdout, done.stderr[-2000:]
    assert "terminate called" not in done.stderr and "dec_ref" not in done.stderr, done.stderr[-2000:]


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
    assert native_hooks.status() == native_hooks.problem() and native_hooks.status().startswith("the C++ update hook")
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


def _node_names(tensor: torch.Tensor) -> list[str]:
    """The names of the autograd nodes upstream of ``tensor``, its own first, then in a depth-first walk."""
    names, stack = [], [tensor.grad_fn]
    while stack:
        node = stack.pop()
        if node is not None:
            names.append(node.name())
            stack.extend(next_node for next_node, _ in reversed(node.next_functions))
    return names


LAYOUTS = ["2d", "2d_column_major", "3d", "3d_transposed_input", "no_bias", "bias_only", "conv1d"]


def _layer_run(layout: str, native: bool, loss: str) -> tuple:
    """One fused layer's forward and backward on ``layout``'s input: (output, node names, dX, db, weight after)."""
    torch.manual_seed(3)
    if layout == "conv1d":
        transformers = pytest.importorskip("transformers")
        model = nn.Sequential(transformers.pytorch_utils.Conv1D(24, WIDTH))
    else:
        model = nn.Sequential(nn.Linear(WIDTH, 24, bias=layout != "no_bias"))
    model = model.to(DEVICE, torch.bfloat16)
    probe = torch.zeros(2, WIDTH, device=DEVICE, dtype=torch.bfloat16)
    opt = forge_core.fuse(model, "adamw", backend="triton", probe_inputs=probe, **HP)
    binding = opt.fused_weights()[0]
    if DEVICE == "cpu":
        binding.update_graphs = UpdateGraphs(launch_path_counts(), rerun_recorder)
    if native:
        assert opt.attach_native_hooks() and binding.native_slot is not None
    else:
        binding.native_slot = None
    shape = {"2d": (6, WIDTH), "2d_column_major": (WIDTH, 6), "3d_transposed_input": (WIDTH, 3, 5)}.get(
        layout, (3, 5, WIDTH))
    x = torch.randn(shape, generator=torch.Generator().manual_seed(4)).to(DEVICE, torch.bfloat16)
    if layout == "3d_transposed_input":
        x = x.permute(1, 2, 0)            # (3, 5, WIDTH), not contiguous: multiplied as a flattened copy
    if layout == "2d_column_major":
        x = x.t()                         # (6, WIDTH), column-major: torch's GEMM backward transposes
    x.requires_grad_(layout != "bias_only")
    output = model(x)
    (output.float().square().sum() if loss == "square" else output.sum()).backward()
    bias = model[0].bias
    return (output.detach(), _node_names(output), x.grad, None if bias is None else bias.grad,
            binding.matrix.detach().clone())


@needs_extension
@pytest.mark.parametrize("loss", ["square", "sum"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_cpp_forward_computes_what_the_python_forward_does(layout: str, loss: str) -> None:
    """The same output, dX, bias gradient and updated weight, bit for bit, as the Python hooked forward's
    graph of torch nodes, for each input layout it takes (a 3-D view, a column-major 2-D input, MLP-Mixer's
    transposed token input, no bias, a bias the only input needing a gradient, GPT-2's Conv1D with its
    (Din, Dout) weight) and for a dY that is a real tensor or an expanded one (``sum()``); its graph is one
    node from the output to the input's (and the bias's)."""
    native_run, python_run = _layer_run(layout, True, loss), _layer_run(layout, False, loss)
    for native_value, python_value in zip(native_run, python_run):
        if isinstance(native_value, torch.Tensor) or native_value is None:
            assert (native_value is None and python_value is None) or torch.equal(native_value, python_value)
    native_names, python_names = native_run[1], python_run[1]
    leaves = sorted(name for name in python_names if name.endswith("AccumulateGrad"))
    assert native_names[0] == "FusedLinearBackward" and sorted(native_names[1:]) == leaves
    assert len(python_names) >= len(native_names)


@needs_extension
def test_the_cpp_node_refuses_a_second_backward() -> None:
    """``retain_graph=True`` then a second backward: FORGE's one-line refusal (the weight updates once a
    forward); a second backward through a released graph: torch's own error."""
    layers = _layers()
    opt = _fuse(layers, native=True)
    x = torch.randn(4, WIDTH, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
    output = layers[0](x)
    output.float().sum().backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="run backward twice"):
        output.float().sum().backward()
    opt.step()
    output = layers[0](x)
    output.float().sum().backward()
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        output.float().sum().backward()


@needs_extension
def test_the_short_forward_serves_only_what_the_cpp_forward_takes(monkeypatch: pytest.MonkeyPatch) -> None:
    """``native_forward`` hands a C++-hooked layer's input straight to the C++ forward, and declines (None, the
    full forward then decides) a layer without a slot, the fuse-time probe's counted forwards, grad off,
    autocast, ``torch.compile`` tracing and ``FORGE_HOOKED_LINEAR=0``; through the module, a declined forward
    still counts and computes."""
    layers = _layers()
    _fuse(layers, native=True)
    layer = layers[0]
    x = torch.randn(4, WIDTH, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
    output = native_forward(layer, x)
    assert output is not None and _node_names(output)[0] == "FusedLinearBackward"
    assert torch.equal(output, nn.functional.linear(x, layer.weight, layer.bias))
    assert native_forward(nn.Linear(WIDTH, WIDTH).to(DEVICE, torch.bfloat16), x) is None
    with torch.no_grad():
        assert native_forward(layer, x) is None
    with torch.autocast(DEVICE, dtype=torch.bfloat16):
        assert native_forward(layer, x) is None
    with monkeypatch.context() as compiling:
        compiling.setattr(torch.compiler, "is_compiling", lambda: True)
        assert native_forward(layer, x) is None
    layer.forge_counting_forwards, layer.forge_forward_calls = True, 0
    assert native_forward(layer, x) is None
    layer(x)
    assert layer.forge_forward_calls == 1
    layer.forge_counting_forwards = False
    monkeypatch.setattr(linear_module, "HOOKED_LINEAR", False)
    assert native_forward(layer, x) is None
    assert _node_names(layer(x))[0] == "FusedLinearFunctionBackward"


@needs_extension
def test_the_cpp_forward_declines_what_the_function_computes() -> None:
    """Mixed dtypes, a 1-D input, an input and bias that need no gradient: None, so the Function runs."""
    layers = _layers()
    opt = _fuse(layers, native=True)
    slot, weight = opt.fused_weights()[0].native_slot, layers[0].weight
    bias = layers[0].bias
    assert native_hooks.hooked_forward(torch.randn(4, WIDTH, device=DEVICE, requires_grad=True), weight, bias, slot,
                                       False) is None
    assert native_hooks.hooked_forward(torch.randn(WIDTH, device=DEVICE, dtype=torch.bfloat16, requires_grad=True),
                                       weight, bias, slot, False) is None
    frozen = torch.randn(4, WIDTH, device=DEVICE, dtype=torch.bfloat16)
    assert native_hooks.hooked_forward(frozen, weight, bias.detach(), slot, False) is None


@needs_extension
def test_hooks_attached_again_take_over_the_recordings_already_made() -> None:
    """A second ``attach_native_hooks`` (new slots) lists each earlier recording at its next Python replay, so
    the C++ hooks replay them again from the step after."""
    layers, opt, inputs, grads = _replaying()
    assert opt.attach_native_hooks()
    _backward(layers, inputs, grads)           # the gate opens at the first replay; the rest are listed one by one
    opt.step()
    before = native_hooks.native_replays()
    _backward(layers, inputs, grads)
    opt.step()
    assert native_hooks.native_replays() - before == LAYERS - 1


def test_the_ninja_package_is_found_where_path_lacks_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """A venv's python run by its path has no ninja on PATH: the loader is given the ninja package's."""
    ninja = pytest.importorskip("ninja")
    seen = []

    def loader(**kwargs):
        seen.append(shutil.which("ninja"))
        raise RuntimeError("stop here")

    from torch.utils import cpp_extension
    monkeypatch.setattr(native_hooks, "_extension", None)
    monkeypatch.setattr(native_hooks, "_problem", None)
    monkeypatch.setattr(native_hooks, "NATIVE_HOOKS", True)
    monkeypatch.setattr(cpp_extension, "load", loader)
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.warns(RuntimeWarning, match="stop here"):
        native_hooks.load()
    assert seen and seen[0].startswith(ninja.BIN_DIR) and os.environ["PATH"] == "/nonexistent"


@needs_extension
def test_the_compiled_backwards_operator_replays_as_the_hook_does(monkeypatch: pytest.MonkeyPatch) -> None:
    """``forge::update_weight_``, which a compiled backward calls once per fused layer, has the extension's kernel:
    given its owner's own tensors (Inductor re-inplaces it) it replays the recordings as the C++ hook does, and
    trains bit for bit as the Python hook; given copies of them (functionalization, ``opcheck``) it runs the
    Python body, which writes the copies and replays nothing."""
    monkeypatch.setattr(native_hooks, "ON_CPU_TOO", True)
    monkeypatch.setattr(native_hooks, "_traced_kernels", {})    # this test's registration, dropped after it
    operated, hooked = _layers(), _layers()
    opt, reference = _fuse(operated, native=True), _fuse(hooked, native=False)
    assert set(native_hooks._traced_kernels) == {DEVICE.upper()}
    inputs, grads = _static_roots()
    generator = torch.Generator().manual_seed(3)

    def operator_calls(weights: list[torch.Tensor], written: list[list[torch.Tensor]]) -> None:
        for binding, weight, states, x, dy in zip(opt.fused_weights(), weights, written, inputs, grads):
            torch.ops.forge.update_weight_.default(x.detach(), dy, weight, states, opt.device_scalars_of(binding), [],
                                                   binding.trace_key)

    own_weights = [binding.weight for binding in opt.fused_weights()]
    own_written = [forge_core.traced.written_tensors(binding) for binding in opt.fused_weights()]
    before = native_hooks.native_replays()
    for _ in range(5):
        _random_fill([*inputs, *grads], generator)
        operator_calls(own_weights, own_written)
        opt.step()
        _backward(hooked, inputs, grads)
        reference.step()
    assert native_hooks.native_replays() - before == 3 * (LAYERS - 1)  # launched, recorded, then replayed
    _assert_trained_alike(opt, reference, steps=5)

    copied = [[tensor.clone() for tensor in states] for states in own_written]
    weights = [w.detach().clone() for w in own_weights] if forge_core.traced.DECLARES_WEIGHT_MUTATION else own_weights
    kept = [[tensor.clone() for tensor in states] for states in own_written]
    replays = native_hooks.native_replays()
    operator_calls(weights, copied)
    opt.step()
    assert native_hooks.native_replays() == replays
    for states, copies, originals in zip(own_written, copied, kept):
        assert all(torch.equal(state, original) for state, original in zip(states, originals))
        assert not all(torch.equal(copy, original) for copy, original in zip(copies, originals))
