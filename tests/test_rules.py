"""Each rule's plain-torch reference (the spec) against torch.optim, and the rule registry."""
import pytest
import torch

from forge_core.rules import RULES, get_rule
from forge_core.rules.lion import Lion


def _run_reference(rule_name, hp, weight0, grads):
    rule = get_rule(rule_name)
    weight = weight0.clone()
    states = {name: torch.zeros_like(weight) for name in rule.state_names}
    for step, grad in enumerate(grads, start=1):
        rule.reference(weight, grad.clone(), states, hp, step)
    return weight


def _run_torch(optimizer_cls, hp, weight0, grads):
    param = torch.nn.Parameter(weight0.clone())
    optimizer = optimizer_cls([param], **hp)
    for grad in grads:
        param.grad = grad.clone()
        optimizer.step()
    return param.detach()


def _data(seed=0, shape=(13, 37), steps=6):
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(shape, generator=gen)
    grads = [torch.randn(shape, generator=gen) * (i + 1) for i in range(steps)]
    return weight, grads


@pytest.mark.parametrize("hp", [
    dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0),
    dict(lr=3e-2, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.1),
])
def test_adamw_reference_is_torch_adamw(hp):
    weight, grads = _data()
    ours = _run_reference("adamw", hp, weight, grads)
    theirs = _run_torch(torch.optim.AdamW, dict(hp, foreach=False), weight, grads)
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-7)
    assert not torch.equal(ours, weight)


@pytest.mark.parametrize("hp", [
    dict(lr=0.1),
    dict(lr=0.1, momentum=0.9),
    dict(lr=0.1, momentum=0.9, dampening=0.3, weight_decay=0.01),
    dict(lr=0.05, momentum=0.8, nesterov=True, weight_decay=0.1),
])
def test_sgd_reference_is_torch_sgd(hp):
    weight, grads = _data(1)
    ours = _run_reference("sgd", hp, weight, grads)
    theirs = _run_torch(torch.optim.SGD, dict(hp, foreach=False), weight, grads)
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-6)


def test_lion_reference_follows_the_paper_in_float64():
    weight, grads = _data(2, steps=4)
    lr, beta1, beta2, wd = 1e-2, 0.9, 0.99, 0.1
    ours = _run_reference("lion", dict(lr=lr, betas=(beta1, beta2), weight_decay=wd), weight, grads)
    w, m = weight.double(), torch.zeros_like(weight, dtype=torch.float64)
    for g in grads:
        g = g.double()
        w = w * (1 - lr * wd) - lr * torch.sign(beta1 * m + (1 - beta1) * g)
        m = beta2 * m + (1 - beta2) * g
    torch.testing.assert_close(ours.double(), w, rtol=1e-6, atol=1e-6)


def test_lion_optimizer_is_the_reference_and_handles_bf16():
    weight, grads = _data(3)
    hp = dict(lr=1e-2, betas=(0.9, 0.99), weight_decay=0.1)
    torch.testing.assert_close(_run_torch(Lion, hp, weight, grads), _run_reference("lion", hp, weight, grads))
    param = torch.nn.Parameter(weight.bfloat16())
    opt = Lion([param], **hp)
    param.grad = grads[0].bfloat16()
    opt.step()
    assert param.dtype == torch.bfloat16 and opt.state[param]["exp_avg"].dtype == torch.bfloat16
    assert opt.state[param]["step"] == 1


@pytest.mark.parametrize("name,expected", [("adamw", torch.optim.AdamW), ("sgd", torch.optim.SGD), ("lion", Lion)])
def test_fallback_optimizer_takes_the_rule_hyper_parameters(name, expected):
    rule = get_rule(name)
    param = torch.nn.Parameter(torch.zeros(3))
    hp = dict(rule.defaults, lr=0.123)
    optimizer = rule.fallback_optimizer([param], **hp, params_extra_key_is_ignored=1)
    assert isinstance(optimizer, expected)
    assert optimizer.param_groups[0]["lr"] == 0.123


KERNEL_RULES = ("adamw", "sgd", "lion", "rmsprop", "adagrad", "adamax", "nadam", "radam", "lamb")
LAYER_RULES = {"muon", "adafactor", "adalomo", "sm3", "adam_mini", "lars"}


def test_registry_and_rule_shape():
    assert set(KERNEL_RULES) | LAYER_RULES <= set(RULES)
    assert get_rule("AdamW") is RULES["adamw"]
    with pytest.raises(ValueError, match="unknown optimizer rule"):
        get_rule("adafactorial")
    for name in KERNEL_RULES:
        rule = RULES[name]
        assert 1 <= len(rule.state_names) <= 3
        assert rule.epilogue is not None and rule.kernel_scalars is not None
        assert len(rule.kernel_scalars(dict(rule.defaults), 3)) <= 8
        assert rule.resolve_hp({"lr": 0.5, "params": []})["lr"] == 0.5
        assert set(rule.states_for(rule.defaults)) <= set(rule.state_names)
    for name in LAYER_RULES:          # stepped in plain torch after the layer's GEMM (forge_core.layer_step)
        rule = RULES[name]
        assert rule.regime in (2, 3) and rule.epilogue is None and rule.state_dtypes == {"fp32", "bf16"}
        assert (rule.layer_update is not None) == (rule.regime == 2)
        assert rule.resolve_hp({"lr": 0.5, "params": []})["lr"] == 0.5
    assert RULES["adamw"].sqrt_domain_states == {"exp_avg_sq"}
    assert RULES["sgd"].states_for({"momentum": 0.0}) == () and RULES["sgd"].states_for(None) == ("momentum_buffer",)


@pytest.mark.parametrize("name,bad,match", [
    ("adamw", dict(lr=-1.0), "lr"), ("adamw", dict(betas=(1.0, 0.9)), "betas"), ("adamw", dict(eps=-1.0), "eps"),
    ("sgd", dict(nesterov=True, momentum=0.0), "nesterov"), ("sgd", dict(momentum=-0.1), "momentum"),
    ("lion", dict(weight_decay=-1.0), "weight_decay"),
])
def test_bad_hyper_parameters_raise_a_clear_error(name, bad, match):
    rule = get_rule(name)
    with pytest.raises(ValueError, match=match):
        rule.kernel_scalars(dict(rule.defaults, **bad), 1)
    with pytest.raises(ValueError, match=match):
        w = torch.zeros(2, 2)
        rule.reference(w, w.clone(), {n: torch.zeros(2, 2) for n in rule.state_names}, dict(rule.defaults, **bad), 1)


def test_step_must_be_one_based():
    with pytest.raises(ValueError, match="1-based"):
        get_rule("adamw").kernel_scalars({}, 0)
