"""Compile a Triton or Gluon kernel for a GPU this machine does not have.

Why: device time is scarce, and registers, spills and shared memory can be read from the compiler
on a CPU machine (``scripts/offline_sass.py``, ``hopper_ws.compile_offline``, the CPU tests). CPU
tensors stand in for the arguments: only their dtypes, shapes and strides are read.
"""
from __future__ import annotations

from typing import Any


def compile_for_gpu(kernel: Any, args: tuple, kwargs: dict, capability: int = 90, source_class: Any = None,
                    **option_overrides: Any) -> Any:
    """``kernel`` bound to ``args`` / ``kwargs`` as a launch would bind them, compiled for
    ``sm_<capability>`` (``source_class``: Triton's ``ASTSource``, or Gluon's ``GluonASTSource``;
    ``option_overrides``: compile options to force, e.g. ``enable_fp_fusion``). Returns Triton's
    compiled kernel (``.asm["cubin"]``, ``.metadata``)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile as triton_compile, make_backend
    from triton.runtime.jit import create_function_from_signature

    target = GPUTarget("cuda", capability, 32)
    backend = make_backend(target)
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    bound, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = kernel._pack_args(backend, kwargs, bound, specialization, options)
    if option_overrides:
        options = backend.parse_options(dict(options.__dict__, **option_overrides))
    source = (source_class or ASTSource)(kernel, signature, constexprs, attrs)
    return triton_compile(source, target=target, options=options.__dict__)
