"""torch's fused AdamW over the parameters FORGE does not fuse, replayed from recordings of its own step
(``forge_core.fallback_graphs``). On the CPU a stand-in recorder keeps what a CUDA graph keeps (the step's work and the
lr tensors it reads) and replays it; on a GPU the recordings are CUDA graphs, inside a fused model's ``step()``."""
from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import forge_core
from forge_core.fallback_graphs import FallbackGraphs, fallback_graphs_problem

HP = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs exist on CUDA only")


class _Recording:
    """A stand-in for a CUDA graph of ``optimizer.step``: it runs the step again at each replay, reading the lr
    tensors the groups held when it was recorded (a graph holds their addresses, not their values)."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer
        self.lrs = [group["lr"] for group in optimizer.param_groups]
        self.replays = 0

    def replay(self) -> None:
        groups = self.optimizer.param_groups
        saved = [group["lr"] for group in groups]
        for group, lr in zip(groups, self.lrs):
            group["lr"] = lr
        try:
            self.optimizer.step()
        finally:
            for group, lr in zip(groups, saved):
                group["lr"] = lr
        self.replays += 1


def _parameters(seed: int, shapes=((7,), (5,), (3, 4))) -> list[nn.Parameter]:
    generator = torch.Generator().manual_seed(seed)
    return [nn.Parameter(torch.randn(shape, generator=generator)) for shape in shapes]


def _gradients(params: list[nn.Parameter], step: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(100 + step)
    return [torch.randn(p.shape, generator=generator) for p in params]


def _recorded(params: list[nn.Parameter]) -> tuple[torch.optim.Optimizer, FallbackGraphs, list[_Recording]]:
    optimizer = torch.optim.AdamW(params, fused=True, **HP)
    recordings: list[_Recording] = []

    def record(update, device):                       # what record_cuda_graph does, without a GPU
        recordings.append(_Recording(optimizer))
        return recordings[-1]

    return optimizer, FallbackGraphs(optimizer, recorder=record), recordings


def test_replayed_steps_equal_torchs_steps_with_a_tensor_lr_under_a_schedule() -> None:
    """Eight steps under a cosine lr, the gradients written in place (a steady loop's placement): the placement
    is recorded at its second step and replayed after, and every weight and moment equals torch's fused AdamW
    whose lr is a float32 tensor (what every step of the recorded optimizer reads) bit for bit."""
    ours, reference = _parameters(0), _parameters(0)
    optimizer, graphs, recordings = _recorded(ours)
    lr = torch.tensor(HP["lr"], dtype=torch.float32)
    torch_optimizer = torch.optim.AdamW(reference, fused=True, **{**HP, "lr": lr})
    for p, q in zip(ours, reference):
        p.grad, q.grad = torch.zeros_like(p), torch.zeros_like(q)
    for step in range(8):
        value = HP["lr"] * 0.5 * (1 + math.cos(math.pi * step / 8))
        for group in optimizer.param_groups:
            group["lr"] = value
        lr.fill_(value)
        for p, q, g in zip(ours, reference, _gradients(ours, step)):
            p.grad.copy_(g)
            q.grad.copy_(g)
        assert graphs.step()
        torch_optimizer.step()
        for p, q in zip(ours, reference):
            assert torch.equal(p, q), step
    assert len(recordings) == 1 and graphs.replays == 7 and recordings[0].replays == 7
    assert all(isinstance(group["lr"], float) for group in optimizer.param_groups)   # the groups keep their own
    for p, q in zip(ours, reference):
        for name in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(optimizer.state[p][name], torch_optimizer.state[q][name]), name


def test_a_moved_gradient_launches_and_a_changed_number_forgets_the_recordings() -> None:
    """A gradient at a new address is a new placement (launched, then recorded when it comes back); a change of
    betas, eps or weight decay (numbers the kernel is handed) drops every recording."""
    params = _parameters(1)
    optimizer, graphs, recordings = _recorded(params)
    for p in params:
        p.grad = torch.ones_like(p)
    graphs.step()
    graphs.step()
    assert len(recordings) == 1 and graphs.replays == 1
    params[0].grad = torch.ones_like(params[0])            # a new block: launched
    graphs.step()
    assert len(recordings) == 1 and graphs.replays == 1
    optimizer.param_groups[0]["weight_decay"] = 0.0
    graphs.step()
    assert graphs.graphs == {} and graphs.replays == 1


def test_no_recording_before_every_parameter_with_a_gradient_has_its_states() -> None:
    """A parameter whose first gradient arrives late would have its states made inside the recording (zeroed at
    every replay): its placement is launched until a launched step has made them."""
    params = _parameters(2)
    optimizer, graphs, recordings = _recorded(params)
    params[0].grad = torch.ones_like(params[0])
    graphs.step()
    graphs.step()
    assert len(recordings) == 1
    params[1].grad = torch.ones_like(params[1])
    graphs.step()                                           # new placement: launched, makes params[1]'s states
    assert params[1] in optimizer.state and len(recordings) == 1
    graphs.step()
    assert len(recordings) == 2


def test_why_a_step_cannot_be_replayed_is_one_line() -> None:
    cpu = _parameters(3)
    assert fallback_graphs_problem(torch.optim.AdamW(cpu, fused=True), enabled=False) == "FORGE_UPDATE_GRAPHS=0"
    assert fallback_graphs_problem(torch.optim.SGD(cpu, lr=0.1)) == "SGD is not torch's Adam or AdamW"
    assert fallback_graphs_problem(torch.optim.AdamW(cpu)) == "not torch's fused implementation (fused=True)"
    assert fallback_graphs_problem(torch.optim.AdamW(cpu, fused=True, lr=torch.tensor(0.1))) == \
        "a differentiable step or a tensor lr of the caller's"
    assert fallback_graphs_problem(torch.optim.AdamW(cpu, fused=True)) == \
        "CUDA graphs need every parameter on one CUDA device"
    assert fallback_graphs_problem(torch.optim.AdamW([{"params": []}], fused=True)) == "no parameters"


class _Spy:
    """Stands for an optimizer's ``FallbackGraphs``: counts its calls, and leaves every step to torch."""

    def __init__(self) -> None:
        self.steps = self.clears = 0

    def step(self) -> bool:
        self.steps += 1
        return False

    def clear(self) -> None:
        self.clears += 1


def test_step_asks_the_recordings_first_and_a_loaded_state_dict_forgets_them() -> None:
    """``step()`` hands the fallback's step to its recordings (torch's own where they decline), and
    ``load_state_dict`` drops them: torch makes new state tensors, which a recording would not write."""
    model = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 4))
    optimizer = forge_core.fuse(model, "adamw", backend="reference", probe_inputs=(torch.randn(2, 8),), **HP)
    assert optimizer._fallback_graphs is None                  # on the CPU torch's step runs as it is
    spy = optimizer._fallback_graphs = _Spy()
    model(torch.randn(4, 8)).square().mean().backward()
    before = [p.detach().clone() for p in model[1].parameters()]
    optimizer.step()
    assert spy.steps == 1 and not any(torch.equal(a, b) for a, b in zip(before, model[1].parameters()))
    optimizer.load_state_dict(optimizer.state_dict())
    assert spy.clears == 1


@needs_cuda
@pytest.mark.gpu
def test_a_fused_models_fallback_step_replays_bit_for_bit_on_the_gpu() -> None:
    """A bf16 MLP with LayerNorms and biases fused on the GPU, its torch-stepped parameters replayed from CUDA
    graphs in one optimizer and launched in the other (a recorder that records nothing: the same float32 lr
    tensor), under a cosine schedule: every parameter equal after each step, the steps from the third on
    replayed."""
    models = []
    for _ in range(2):
        torch.manual_seed(0)
        models.append(nn.Sequential(nn.Linear(64, 128), nn.LayerNorm(128), nn.GELU(), nn.Linear(128, 64),
                                    nn.LayerNorm(64)).cuda().bfloat16())
    replayed, launched = (forge_core.fuse(m, "adamw", **HP) for m in models)
    assert replayed._fallback_graphs is not None
    launched._fallback_graphs = FallbackGraphs(launched._fallback, recorder=lambda update, device: None)
    schedules = [torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=8) for opt in (replayed, launched)]
    x = torch.randn(16, 64, device="cuda", dtype=torch.bfloat16)
    for step in range(8):
        for model, opt, schedule in zip(models, (replayed, launched), schedules):
            model(x).float().square().mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=False)
            schedule.step()
        for (name, a), b in zip(models[0].named_parameters(), models[1].parameters()):
            assert torch.equal(a, b), (step, name)
    assert replayed._fallback_graphs.replays >= 5
