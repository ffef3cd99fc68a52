"""A stand-in for Triton 3.6's compiled-kernel launch objects, for the direct-launcher tests
(test_kernels.py for the Triton kernel, test_hopper_ws.py for the Gluon kernel) on a CPU machine.

What it mimics: ``compiled.run.launch`` is the descriptor wrapper whose closure holds the raw
launcher, the descriptor parameter indices and their metadata; the nvidia driver module's base
argument format; ``fill_tma_descriptor``. The raw launcher records its arguments; the fill records
what it encoded and returns ``"map@<address>"``."""
from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Any


def descriptor_meta(block: list[int], swizzle: int = 128, elem_type: int = 5, elem_size: int = 2) -> dict:
    return {"swizzle": swizzle, "elem_size": elem_size, "elem_type": elem_type, "block_size": block,
            "fp4_padded": False}


@dataclass
class FakeLaunch:
    calls: list = field(default_factory=list)
    encoded: list = field(default_factory=list)
    compiled: object = None
    driver: object = None


def install(monkeypatch, descriptor_indices: set[int], metas: list[dict], device: int = 0, stream: int = 99) -> FakeLaunch:
    """Patch ``triton.runtime.driver`` and ``sys.modules['triton.backends.nvidia.driver']`` as Triton
    3.6 lays them out, and return the recorder with a compiled kernel whose descriptors sit at
    ``descriptor_indices``."""
    import triton

    fake = FakeLaunch()

    def wrap_like_triton_36(launcher, tensordesc_indices, tensordesc_meta):
        def inner(*args):       # its closure holds the three, as Triton 3.6's does
            raise AssertionError(f"the descriptor wrapper must be skipped {launcher, tensordesc_indices, tensordesc_meta}")
        return inner

    class FakeRun:
        global_scratch_size = profile_scratch_size = 0
        launch_cooperative_grid, launch_pdl = False, True
        launch = wrap_like_triton_36(lambda *args: fake.calls.append(args), set(descriptor_indices), metas)

        def __call__(self, *args):
            raise AssertionError("the launcher object's __call__ must be skipped")

    class FakeCompiled:
        function, packed_metadata, run = "function-handle", "packed", FakeRun()

        @staticmethod
        def launch_metadata(grid, stream, *args):
            return None

    class FakeUtils:
        @staticmethod
        def fill_tma_descriptor(ptr, swizzle, elem_size, elem_type, block, shape, strides, padding):
            fake.encoded.append((swizzle, elem_type, tuple(block), padding))
            return f"map@{ptr}"

    class FakeActive:
        utils = FakeUtils()

        def get_current_device(self):
            return device

        def get_current_stream(self, index):
            return stream

    nvidia_driver = type(sys)("triton.backends.nvidia.driver")
    nvidia_driver._BASE_ARGS_FORMAT = "iiiKKppOOOOOO"
    nvidia_driver.TMA_DTYPE_DEVICE_TO_HOST = {5: 6, 0: 0}
    monkeypatch.setitem(sys.modules, "triton.backends.nvidia.driver", nvidia_driver)
    monkeypatch.setattr(triton.runtime, "driver", type("FakeDriver", (), {"active": FakeActive()})())
    fake.compiled, fake.driver = FakeCompiled(), nvidia_driver
    return fake


def plain_compiled(calls: list, metadata: Any = None) -> Any:
    """A compiled kernel without descriptors whose ``run`` appends its arguments to ``calls``;
    ``launch_metadata`` returns ``metadata(grid, stream, *args)`` (None without it)."""

    class PlainCompiled:
        function, packed_metadata = "function-handle", "packed"

        @staticmethod
        def run(*args):
            calls.append(args)

        @staticmethod
        def launch_metadata(grid, stream, *args):
            return metadata(grid, stream, *args) if metadata is not None else None

    return PlainCompiled()


class FakeActive:
    """``triton.runtime.driver.active``: a current device to change, streams ``stream_base + index``."""

    def __init__(self, device: int = 0, stream_base: int = 1000) -> None:
        self.device, self.stream_base = device, stream_base

    def get_current_device(self):
        return self.device

    def get_current_stream(self, index):
        return self.stream_base + index
