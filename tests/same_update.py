"""The comparison the row-gradient tests share: a tensor a row step produced against the dense step's."""
from __future__ import annotations

import torch


def assert_same_update(ours: torch.Tensor, theirs: torch.Tensor, what: str, exact: bool) -> None:
    """Bit for bit where ``exact`` (the CPU interpreter). On the GPU the row step is another kernel than
    the dense update, and the compiler may contract a multiply-add into an FMA differently in each (as
    between any two tiles of the fused kernel): values then agree to an ulp or two, int8 codes to one."""
    if exact:
        assert torch.equal(ours.view(torch.uint8), theirs.view(torch.uint8)), what       # the bits, -0.0 too
    elif ours.dtype == torch.int8:
        assert (ours.int() - theirs.int()).abs().max() <= 1, what
    else:
        torch.testing.assert_close(ours, theirs, rtol=4e-6 if ours.dtype == torch.float32 else 1e-2, atol=1e-7,
                                   msg=lambda m: f"{what}: {m}")
