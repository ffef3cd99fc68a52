"""Every rule x state format x fused path against the rule's torch optimizer with fp32 states, a new
batch each step (``tests/differential_paths.py``: a Linear, a Conv1D, 3-D experts, an embedding stepped
from rows, one stepped from its dense ``.grad``, a 2-D Parameter and a tied weight; rows, columns and an
expert first reached at step 3, and some never).

What is asserted of each weight at each step:

* its move is within the rule's bound (``differential_paths.move_ratio``), times the format's
  ``MOVE_SLACK``, where the rule bounds it (not SGD, RAdam before rho_t > 5, centered RMSprop);
* an element torch never moves (no gradient ever reached it) stays exactly where it started;
* with fp32 states it equals torch's weight (``EQUAL``); with bf16, int8 or fp8 states its trajectory
  after the last step is within the format's documented distance of torch's (``TRAJECTORY``,
  docs/design.md section 10).

CPU (``make test``): the reference backend for every combination, and the Triton kernels in the
interpreter for a few (``INTERPRETED``); on a machine with CUDA the Triton kernels run every
combination on the GPU, and ``test_gpu_gluon_kernel_paths`` steps the Linear and Conv1D weights with the
warp-specialized Gluon kernel wherever it takes the call. ``pytest -m sweep tests/test_differential.py``
runs the larger sweep (more steps, seeds and hyper-parameters; every combination interpreted on a CPU).
"""
from __future__ import annotations

import functools
from typing import Any

import pytest
import torch

import differential_paths as paths
import forge_core
import forge_core.layer_step
import forge_core.optimizer

pytest.importorskip("transformers")

KERNEL_RULES = ("adamw", "sgd", "lion", "rmsprop", "adagrad", "adamax", "nadam", "radam", "lamb")
LAYER_RULES = ("muon", "adafactor", "adalomo", "sm3", "adam_mini", "lars", "galore_adamw")
FORMATS = ("fp32", "bf16", "int8", "fp8")
STEPS = 6
CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
INTERPRETED = (("adamax", "int8"),)
"""The combinations the CPU runs through the interpreted Triton kernels in ``make test`` (about 10 s each;
``-m sweep`` runs them all): int8 Adamax, whose floored ``exp_inf`` every kernel path codes."""

MOVE_SLACK = {"fp32": 1.0 + 1e-5, "bf16": 1.02, "int8": 2.0, "fp8": 1.25}
"""How far past the rule's bound a step may go with each state format (docs/design.md, section 10): fp32
rounding (a bound torch attains: Lion's, LAMB's); bf16 moments (2^-9 relative each); an int8 first moment a
code up and a second moment half a code down (measured up to 1.67); fp8's 1/16-relative grid (up to 1.07)."""
TRAJECTORY = {"bf16": 0.02, "int8": 0.6, "fp8": 0.06}
"""rms(W - W_torch) / rms(W_torch - W_0) after the last step, at most (docs/design.md, section 10; measured over
6 and 10 steps and three seeds: bf16 0.011, int8 0.49, fp8 0.037). int8 is far: the inputs' columns span three
decades, and a value below 1/254 of its 64-column block's largest codes 0, so its element stops where torch
moves it (fp8's relative grid keeps it)."""
SIGN_RULES = {"lion": 2.5}
"""A rule whose step is a moment's sign: a rounding that flips a moment near 0 moves its element 2 lr the other
way, so its bf16 and fp8 trajectories are this much further (measured: bf16 0.042, fp8 0.086)."""
EQUAL = 1e-3
"""fp32 states: max |W - W_torch| over the largest move of torch's weight, at most (Muon: steps x adjusted lr x
2^-6, the rounding of torch's own bf16 Newton-Schulz)."""


@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny tensors: one intra-op thread. A second costs milliseconds of synchronisation per op on a busy
    2-core machine (torch.round of 10k elements: 15 ms, against 3 us on one thread)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@functools.lru_cache(maxsize=None)
def _torch_run(rule_name: str, steps: int, seed: int, experts: bool, device: str,
               dims: paths.Dims = paths.SMALL, variant: str = "") -> paths.Run:
    return paths.torch_run(rule_name, paths.make_batches(steps, seed, dims), device=device, experts=experts, dims=dims,
                           variant=variant)


def _stepping_rule(rule_name: str, how: str, variant: str = "") -> tuple[str, dict[str, Any]]:
    """The rule that steps a weight stepped ``how`` (Muon's fallback is AdamW on its ``adamw_*`` values)."""
    hp = paths.hyperparameters(rule_name, variant)
    if rule_name == "muon" and how == "fallback":
        from forge_core.rules.muon import adamw_hyperparameters
        return "adamw", adamw_hyperparameters(forge_core.get_rule("muon").resolve_hp(hp))
    return rule_name, hp


def check_against_torch(rule_name: str, state_dtype: str, ours: paths.Run, torch_run: paths.Run,
                        variant: str = "") -> None:
    """The assertions of the module docstring, for every path of one run."""
    failures = []
    for path, steps in ours.weights.items():
        theirs = torch_run.weights[path]
        where = f"{rule_name}{' ' + variant if variant else ''} {state_dtype} {path} ({ours.how[path]})"
        bound_rule, hp = _stepping_rule(rule_name, ours.how[path], variant)
        for step in range(1, len(steps)):
            ratio = paths.move_ratio(bound_rule, hp, step, steps[step - 1], steps[step])
            if ratio is not None and ratio > MOVE_SLACK[state_dtype]:
                failures.append(f"{where}: step {step} moved {ratio:.3g} times the rule's bound")
        unmoved = torch.stack([t == theirs[0] for t in theirs]).all(dim=0)
        if not torch.equal(steps[-1][unmoved], theirs[0][unmoved]):
            count = int((steps[-1][unmoved] != theirs[0][unmoved]).sum())
            failures.append(f"{where}: {count} element(s) torch never moved have moved")
        moved = (theirs[-1] - theirs[0]).double()
        error = (steps[-1] - theirs[-1]).double()
        if state_dtype == "fp32":
            largest = float(torch.stack([(b - a).abs().max() for a, b in zip(theirs, theirs[1:])]).max())
            allowed = EQUAL * largest
            if bound_rule == "muon":        # torch's bf16 Newton-Schulz rounds its input (docs/design.md, section 10)
                from forge_core.newton_schulz import adjusted_lr
                allowed = (len(steps) - 1) * adjusted_lr(hp["lr"], None, steps[0].shape) * 2.0 ** -6
            if float(error.abs().max()) > allowed:
                failures.append(f"{where}: max |W - W_torch| {float(error.abs().max()):.3g}, at most {allowed:.3g} "
                                f"(the largest move {largest:.3g})")
        elif float(moved.square().mean()) > 0:
            distance = float(error.square().mean().sqrt() / moved.square().mean().sqrt())
            allowed = TRAJECTORY[state_dtype] * (SIGN_RULES.get(rule_name, 1.0) if state_dtype != "int8" else 1.0)
            if distance > allowed:
                failures.append(f"{where}: trajectory {distance:.3g} from torch's (at most {allowed:.3g})")
    assert not failures, "\n".join(failures)


def _differential(rule_name: str, state_dtype: str, backend: str, monkeypatch: pytest.MonkeyPatch, *,
                  steps: int = STEPS, seed: int = 1, variant: str = "") -> None:
    experts = rule_name in KERNEL_RULES     # the per-layer rules leave 3-D experts to a fallback that takes 2-D only
    if backend == "reference":
        # the per-layer rules' plain-torch reference too: their Triton passes (``Rule.matrix_step``) run
        # wherever Triton does, the CPU interpreter included, whatever the backend
        monkeypatch.setattr(forge_core.layer_step, "MATRIX_KERNELS", None)
        monkeypatch.setattr(forge_core.optimizer, "MATRIX_KERNELS", None)
    batches = paths.make_batches(steps, seed)
    device = DEVICE if backend == "triton" else "cpu"
    ours = paths.forge_run(rule_name, state_dtype, batches, backend=backend, device=device, experts=experts,
                           variant=variant)
    reference = _torch_run(rule_name, steps, seed, experts, device, paths.SMALL, variant)
    check_against_torch(rule_name, state_dtype, ours, reference, variant)


def test_torch_stays_within_each_rules_bound() -> None:
    """The bounds hold for torch itself (fp32): they are the rules' own."""
    for rule_name in KERNEL_RULES + LAYER_RULES:
        run = _torch_run(rule_name, STEPS, 1, rule_name in KERNEL_RULES, "cpu")
        for path, steps in run.weights.items():
            bound_rule, hp = _stepping_rule(rule_name, "fused" if path in ("lin", "conv") else "fallback")
            for step in range(1, len(steps)):
                ratio = paths.move_ratio(bound_rule, hp, step, steps[step - 1], steps[step])
                assert ratio is None or ratio <= MOVE_SLACK["fp32"], (rule_name, path, step, ratio)


@pytest.mark.parametrize("state_dtype", FORMATS)
@pytest.mark.parametrize("rule_name", KERNEL_RULES)
def test_kernel_rules_on_every_path_follow_torch(rule_name: str, state_dtype: str, monkeypatch) -> None:
    _differential(rule_name, state_dtype, "reference", monkeypatch)


@pytest.mark.parametrize("state_dtype", ("fp32", "bf16"))
@pytest.mark.parametrize("rule_name", LAYER_RULES)
def test_layer_rules_follow_torch(rule_name: str, state_dtype: str, monkeypatch) -> None:
    _differential(rule_name, state_dtype, "reference", monkeypatch)


def _kernel_cases() -> list[Any]:
    """On a GPU every kernel rule and format; on a CPU (the interpreter) ``INTERPRETED``."""
    if CUDA:
        return [(rule, fmt) for rule in KERNEL_RULES for fmt in FORMATS]
    return list(INTERPRETED)


@pytest.mark.parametrize("rule_name, state_dtype", _kernel_cases())
def test_triton_kernels_on_every_path_follow_torch(rule_name: str, state_dtype: str, monkeypatch) -> None:
    monkeypatch.setenv("FORGE_AUTOTUNE", "0")     # tiny shapes: the untuned tile (tuning tells nothing here)
    _differential(rule_name, state_dtype, "triton", monkeypatch)


# -- the Gluon kernel (a Hopper GPU) -----------------------------------------------------------------

GLUON_RULES = ("adamw", "sgd", "lion", "rmsprop", "adagrad", "adamax", "nadam", "radam")
"""The rules whose states the Gluon kernel takes here (regime 1, one or two states: SGD with momentum)."""


def _no_gluon_reason() -> str | None:
    if not CUDA:
        return "needs a CUDA device"
    from forge_core.kernels import hopper_ws
    if hopper_ws.GLUON_IMPORT_ERROR is not None:
        return f"Gluon is not importable: {hopper_ws.GLUON_IMPORT_ERROR}"
    if torch.cuda.get_device_capability()[0] != 9:
        return "the warp-specialized kernel needs a Hopper GPU (sm_90)"
    return None


@pytest.mark.gpu
@pytest.mark.skipif(_no_gluon_reason() is not None, reason=str(_no_gluon_reason()))
@pytest.mark.parametrize("state_dtype", ("bf16", "int8"))
@pytest.mark.parametrize("rule_name", GLUON_RULES)
def test_gpu_gluon_kernel_paths(rule_name: str, state_dtype: str, monkeypatch) -> None:
    """bf16 weights at 128 x 128 (``paths.GLUON``): the Linear and Conv1D weights stepped by the Gluon kernel
    (forced: the first candidate that takes the call, untimed), the other paths by the Triton kernels, against
    the same model on the Triton kernels alone: equal within a bf16 step of each weight or 5% of the largest
    move; within the rule's bound (a bf16 weight's rounding allowed); elements torch never moves stay put."""
    from forge_core.kernels import dispatch, ws_choice
    monkeypatch.setenv("FORGE_AUTOTUNE", "0")
    batches = paths.make_batches(STEPS, 1, paths.GLUON)
    triton_run = paths.forge_run(rule_name, state_dtype, batches, backend="triton", device="cuda", dims=paths.GLUON,
                                 dtype=torch.bfloat16)
    forced: list[str] = []

    def gluon_plan(key, state_dtype_, x2, dy2, weight, states, scales, grad_accum, stochastic, scalars, seed, meta,
                   triton_config):
        candidates = ws_choice.candidates_for(x2, dy2, weight, states, scales, state_dtype_, grad_accum, stochastic,
                                              meta["NUM_SUMS"])
        if not candidates:
            return None
        forced.append(f"{tuple(weight.shape)}")
        return dispatch.WsPlan(candidates[0], weight, states, scales, meta["EPILOGUE"],
                               (meta["S0_SQRT"], meta["S1_SQRT"]))

    monkeypatch.setattr(dispatch, "ws_plan", gluon_plan)
    dispatch.PLANS.clear()
    gluon_run = paths.forge_run(rule_name, state_dtype, batches, backend="triton", device="cuda", dims=paths.GLUON,
                                dtype=torch.bfloat16)
    assert len(forced) >= 2, forced                           # the Linear's and the Conv1D's weights
    failures = []
    reference = _torch_run(rule_name, STEPS, 1, True, "cuda", paths.GLUON)
    for path, steps in gluon_run.weights.items():
        theirs = triton_run.weights[path]
        largest = float(torch.stack([(b - a).abs().max() for a, b in zip(theirs, theirs[1:])]).max())
        apart = (steps[-1] - theirs[-1]).abs()
        allowed = torch.clamp(theirs[-1].abs() * 2.0 ** -7, min=0.05 * largest)
        if bool((apart > allowed).any()):
            failures.append(f"{path}: {int((apart > allowed).sum())} element(s) apart from the Triton kernel's run "
                            f"(max {float(apart.max()):.3g})")
        for step in range(1, len(steps)):
            ratio = paths.move_ratio(rule_name, paths.RULE_HYPERPARAMETERS[rule_name], step, steps[step - 1],
                                     steps[step], weight_precision=2.0 ** -8)
            if ratio is not None and ratio > MOVE_SLACK[state_dtype]:
                failures.append(f"{path}: step {step} moved {ratio:.3g} times the rule's bound")
        unmoved = torch.stack([t == reference.weights[path][0] for t in reference.weights[path]]).all(dim=0)
        if not torch.equal(steps[-1][unmoved], steps[0][unmoved]):
            failures.append(f"{path}: elements torch never moved have moved")
    assert not failures, "\n".join(failures)


# -- the larger sweep (pytest -m sweep) --------------------------------------------------------------

@pytest.mark.sweep
@pytest.mark.parametrize("seed, variant", ((2, ""), (3, ""), (2, "variant")))
@pytest.mark.parametrize("state_dtype", FORMATS)
@pytest.mark.parametrize("rule_name", KERNEL_RULES)
@pytest.mark.parametrize("backend", ("reference", "triton"))
def test_sweep_kernel_rules(rule_name: str, state_dtype: str, backend: str, seed: int, variant: str,
                            monkeypatch) -> None:
    """10 steps, two more seeds, and each rule's ``differential_paths.VARIANTS`` setting."""
    monkeypatch.setenv("FORGE_AUTOTUNE", "0")
    _differential(rule_name, state_dtype, backend, monkeypatch, steps=10, seed=seed, variant=variant)


@pytest.mark.parametrize("state_dtype", ("fp32", "bf16"))
def test_centered_rmsprop_follows_torch(state_dtype: str, monkeypatch) -> None:
    """Centered RMSprop with momentum, in the formats it takes (int8 / fp8 are refused at fuse)."""
    _differential("rmsprop", state_dtype, "reference", monkeypatch, variant="centered")


@pytest.mark.parametrize("state_dtype", ("int8", "fp8"))
def test_centered_rmsprop_refuses_int8_and_fp8_states(state_dtype: str) -> None:
    """Its variance, the difference of two moments rounded apart, read back as 0: steps up to 10^6 (int8) and
    2100 (fp8) times torch's largest in this test's model (D92)."""
    with pytest.raises(ValueError, match=rf"^rule 'rmsprop': centered=True cannot keep {state_dtype} states: its "
                                         r"variance square_avg - grad_avg\^2, a difference of two moments rounded "
                                         r"apart, reads back as 0 where it is small and the step becomes g / eps; use "
                                         r"fp32 or bf16 states, or centered=False$"):
        paths.forge_run("rmsprop", state_dtype, paths.make_batches(1), backend="reference", variant="centered")


@pytest.mark.sweep
@pytest.mark.parametrize("state_dtype", ("fp32", "bf16"))
@pytest.mark.parametrize("rule_name", LAYER_RULES)
@pytest.mark.parametrize("backend", ("reference", "triton"))
def test_sweep_layer_rules(rule_name: str, state_dtype: str, backend: str, monkeypatch) -> None:
    monkeypatch.setenv("FORGE_AUTOTUNE", "0")
    _differential(rule_name, state_dtype, backend, monkeypatch, steps=10, seed=2)
