"""The state arena (``forge_core.state_arena``): every fused weight's states as views of one buffer per dtype,
what a traced update is handed, a copy of it updated instead of it, and a checkpoint that holds it once."""
from __future__ import annotations

import io

import pytest
import torch

import forge_core
from forge_core.state_arena import ALIGN, StateArena
from forge_core.traced import state_tensors, written_tensors


def _fused(state_dtype: str = "bf16", rule: str = "adamw") -> tuple[torch.nn.Module, forge_core.ForgeOptimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(24, 40), torch.nn.ReLU(), torch.nn.Linear(40, 17),
                                torch.nn.Linear(17, 9))
    return model, forge_core.fuse(model, rule, lr=1e-2, state_dtype=state_dtype, probe_inputs=False,
                                  backend="reference")


@pytest.mark.parametrize("state_dtype, buffers", [("fp32", [torch.float32]), ("bf16", [torch.bfloat16]),
                                                  ("int8", [torch.int8, torch.float32]),
                                                  ("fp8", [torch.float8_e4m3fn, torch.float32])])
def test_every_fused_weights_states_are_views_of_one_buffer_per_dtype(state_dtype, buffers) -> None:
    _, optimizer = _fused(state_dtype)
    bindings = optimizer.fused_weights()
    arenas = bindings[0].state_arenas
    assert [arena.dtype for arena in arenas] == buffers
    assert all(binding.state_arenas == arenas for binding in bindings)
    regions = []
    for binding in bindings:
        assert written_tensors(binding) == list(arenas)       # the operator is handed the buffers, nothing else
        for tensor in state_tensors(binding):
            arena = next(a for a in arenas if a.untyped_storage().data_ptr() == tensor.untyped_storage().data_ptr())
            assert tensor.is_contiguous() and (tensor.data_ptr() - arena.data_ptr()) % ALIGN == 0
            regions.append((tensor.data_ptr(), tensor.data_ptr() + tensor.numel() * tensor.element_size()))
    regions.sort()
    assert all(end <= start for (_, end), (start, _) in zip(regions, regions[1:])), "views overlap"


def test_the_layer_path_and_its_sums_keep_tensors_of_their_own() -> None:
    """A per-layer rule's states (Muon) and a regime-2 rule's per-layer sums (LAMB) are not in an arena: the
    operator is handed them after the buffers."""
    _, muon = _fused("fp32", "muon")
    assert all(not getattr(binding, "state_arenas", ()) for binding in muon.fused_weights())
    _, lamb = _fused("fp32", "lamb")
    binding = lamb.fused_weights()[0]
    assert written_tensors(binding) == [*binding.state_arenas, binding.state.layer_sums]


def test_an_update_of_copies_writes_the_copies_in_the_weights_place() -> None:
    """Functionalization's copies of the buffers (``aot_eager``, ``opcheck``): the update writes its weight's part
    of the copy, and neither the buffer itself nor another weight's part."""
    _, optimizer = _fused("bf16")
    binding = optimizer.fused_weights()[1]
    arena = binding.state_arenas[0]
    before = arena.clone()
    copies = [arena.clone()]
    weight = binding.weight.detach().clone()
    x, grad_output = torch.randn(5, 40), torch.randn(5, 17)
    torch.ops.forge.update_weight_.default(x, grad_output, weight, copies, optimizer.device_scalars_of(binding), [],
                                           binding.trace_key)
    assert torch.equal(arena, before) and not torch.equal(weight, binding.weight)
    changed = (copies[0] != before).nonzero().flatten()
    start = binding.state.values["exp_avg"].data_ptr() - arena.data_ptr()
    stop = binding.state.values["exp_avg_sq"].data_ptr() - arena.data_ptr() + binding.state.values["exp_avg_sq"].nbytes
    assert changed.numel() and start <= int(changed.min()) * 2 and (int(changed.max()) + 1) * 2 <= stop
    assert binding.state_arenas == (arena,)          # given back after the update


def test_a_saved_state_dict_holds_each_buffer_once_and_loads_back() -> None:
    model, optimizer = _fused("int8")
    for _ in range(2):
        model(torch.randn(3, 24)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    saved = io.BytesIO()
    torch.save(optimizer.state_dict(), saved)
    arenas = optimizer.fused_weights()[0].state_arenas
    assert saved.tell() < sum(arena.nbytes for arena in arenas) + 64 * 1024
    _, fresh = _fused("int8")
    saved.seek(0)
    fresh.load_state_dict(torch.load(saved, weights_only=False))
    for ours, theirs in zip(optimizer.fused_weights(), fresh.fused_weights()):
        assert all(torch.equal(a, b) for a, b in zip(state_tensors(ours), state_tensors(theirs)))


def test_an_arena_hands_out_only_what_it_was_planned_for() -> None:
    arena = StateArena([((2, 3), torch.float32, torch.device("cpu"))])
    view = arena.allocate((2, 3), torch.float32, torch.device("cpu"))
    assert view.shape == (2, 3) and not view.any()
    with pytest.raises(RuntimeError, match="not planned") as info:
        arena.allocate((1,), torch.float32, torch.device("cpu"))
    assert "\n" not in str(info.value)
    with pytest.raises(RuntimeError, match="not planned"):
        arena.allocate((1,), torch.bfloat16, torch.device("cpu"))
