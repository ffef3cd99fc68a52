"""``direct_launch.LaunchCache``: a kernel goes through Triton's JIT once per specialisation, then
through its compiled launcher (grid, runtime arguments, constexprs in Triton 3.6's order); another
specialisation, another current device or the interpreter takes the JIT again. Fakes stand in for
Triton's compiled handle and driver, so this runs on a CPU machine."""
from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from fake_triton_launch import FakeActive, plain_compiled
from forge_core.kernels import direct_launch


def _fake_kernel(jit_calls: list):
    """A kernel whose JIT launch records its call and returns a compiled kernel recording into ``launched``."""
    def kernel_fn(X, n, scale, BLOCK: tl.constexpr, MODE: tl.constexpr):
        pass

    class FakeKernel:
        fn = staticmethod(kernel_fn)

        def __getitem__(self, grid):
            def jit_launch(*args, **constexprs):
                jit_calls.append((grid, args, constexprs))
                return plain_compiled(launched)
            return jit_launch

    return FakeKernel()


launched: list = []


@pytest.fixture
def fake_driver(monkeypatch):
    active = FakeActive(stream_base=500)
    monkeypatch.setattr(triton.runtime, "driver", type("FakeDriver", (), {"active": active})())
    monkeypatch.setattr(direct_launch, "interpreting", lambda: False)
    monkeypatch.delenv("FORGE_DIRECT_LAUNCH", raising=False)
    launched.clear()
    return active


def test_the_second_launch_of_a_specialisation_skips_the_jit(fake_driver) -> None:
    jit_calls: list = []
    counts = {"direct": 0, "jit": 0}
    cache = direct_launch.LaunchCache(_fake_kernel(jit_calls), counts)
    x = torch.zeros(8)
    cache((3, 2), (x, 64, 0.5), BLOCK=32, MODE=True)
    assert len(jit_calls) == 1 and not launched
    cache((3, 2), (x, 64, 0.25), BLOCK=32, MODE=True)       # another float: the same specialisation
    assert len(jit_calls) == 1 and len(launched) == 1
    hooks = (triton.knobs.runtime.launch_enter_hook, triton.knobs.runtime.launch_exit_hook)
    (call,) = launched
    assert call[:9] == (3, 2, 1, 500, "function-handle", "packed", None, *hooks)
    assert call[9] is x and call[10:] == (64, 0.25, 32, True)
    assert counts == {"direct": 1, "jit": 1}


@pytest.mark.parametrize("change", ["int", "dtype", "alignment", "constexpr", "grid"])
def test_another_specialisation_goes_through_the_jit(fake_driver, change: str) -> None:
    jit_calls: list = []
    cache = direct_launch.LaunchCache(_fake_kernel(jit_calls))
    x = torch.zeros(16)
    cache((4,), (x, 64, 0.5), BLOCK=32, MODE=False)
    grid, args, constexprs = (4,), (x, 64, 0.5), dict(BLOCK=32, MODE=False)
    if change == "int":
        args = (x, 65, 0.5)
    elif change == "dtype":
        args = (x.double(), 64, 0.5)
    elif change == "alignment":
        args = (x[1:], 64, 0.5)
    elif change == "constexpr":
        constexprs = dict(BLOCK=64, MODE=False)
    else:
        grid = (5,)
    cache(grid, args, **constexprs)
    assert len(jit_calls) == 2 and not launched
    cache(grid, args, **constexprs)
    assert len(jit_calls) == 2 and len(launched) == 1


def test_another_current_device_or_the_interpreter_takes_the_jit(fake_driver, monkeypatch) -> None:
    jit_calls: list = []
    cache = direct_launch.LaunchCache(_fake_kernel(jit_calls))
    x = torch.zeros(8)
    cache((1,), (x, 8, 1.0), BLOCK=8, MODE=True)
    fake_driver.device = 1
    cache((1,), (x, 8, 1.0), BLOCK=8, MODE=True)
    assert len(jit_calls) == 2 and not launched
    monkeypatch.setattr(direct_launch, "interpreting", lambda: True)
    fresh = direct_launch.LaunchCache(_fake_kernel(jit_calls))
    for _ in range(2):
        fresh((1,), (x, 8, 1.0), BLOCK=8, MODE=True)
    assert len(jit_calls) == 4 and not launched
    monkeypatch.setattr(direct_launch, "interpreting", lambda: False)
    monkeypatch.setenv("FORGE_DIRECT_LAUNCH", "0")
    off = direct_launch.LaunchCache(_fake_kernel(jit_calls))
    for _ in range(2):
        off((1,), (x, 8, 1.0), BLOCK=8, MODE=True)
    assert len(jit_calls) == 6 and not launched


def test_an_unspecialised_integer_keeps_the_direct_launch_when_its_value_changes(fake_driver) -> None:
    """A seed (the kernel's ``do_not_specialize``) is keyed by its type: a new seed every step still
    launches directly; another value of a specialised integer takes the JIT."""
    jit_calls: list = []
    kernel = _fake_kernel(jit_calls)
    kernel.arg_names = ["X", "n", "scale", "BLOCK", "MODE"]
    cache = direct_launch.LaunchCache(kernel, unspecialised=("n",))
    x = torch.zeros(8)
    cache((4,), (x, 64, 0.5), BLOCK=32, MODE=True)
    cache((4,), (x, 65, 0.5), BLOCK=32, MODE=True)
    assert len(jit_calls) == 1 and len(launched) == 1 and launched[0][10] == 65
    specialised = direct_launch.LaunchCache(_fake_kernel(jit_calls))
    specialised((4,), (x, 64, 0.5), BLOCK=32, MODE=True)
    specialised((4,), (x, 65, 0.5), BLOCK=32, MODE=True)
    assert len(jit_calls) == 3
