"""Shared test setup: without CUDA, Triton kernels run in the interpreter.

TRITON_INTERPRET must be set before ``triton.jit`` decorates any kernel, i.e. before anything
imports forge_core, which is why it happens here at conftest import time.
"""
import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
