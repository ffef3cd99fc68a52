"""What the fused kernel's tests share: the device they run on (the GPU when there is one, else the
Triton interpreter), the rules' hyperparameters, odd-shaped inputs, two identical (weight, state)
copies for a fused-against-reference step, and the storage comparison with one rounding step of slack."""
import pytest
import torch

from forge_core.rules import get_rule
from forge_core.state import ParamState

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(autouse=True)
def default_device(monkeypatch):
    """Run every test on the GPU when there is one (the interpreter on CPU otherwise), with the
    untuned default tile configuration on the GPU (tuning is tested on its own: test_tuning.py)."""
    monkeypatch.setenv("FORGE_AUTOTUNE", "0")
    torch.manual_seed(0)
    previous = torch.get_default_device()
    torch.set_default_device(DEVICE)
    yield
    torch.set_default_device(previous)


HP = {
    "adamw": dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1),
    "sgd": dict(lr=1e-2, momentum=0.9, dampening=0.1, weight_decay=0.05),
    "lion": dict(lr=1e-2, betas=(0.9, 0.99), weight_decay=0.1),
}


def make_inputs(dout, din, tokens, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(*tokens, din, generator=gen, device="cpu").to(DEVICE, dtype)
    dy = (torch.randn(*tokens, dout, generator=gen, device="cpu") * 0.1).to(DEVICE, dtype)
    return x, dy


def state_pair(weight, rule_name, state_dtype):
    """Two identical (weight, state) copies, with non-trivial state contents."""
    rule = get_rule(rule_name)
    states = []
    for _ in range(2):
        states.append((weight.clone(), ParamState(weight, rule, state_dtype)))
    gen = torch.Generator().manual_seed(7)
    for name in rule.state_names:
        value = torch.randn(weight.shape, generator=gen, device="cpu").to(weight.device)
        value = value.abs() * 1e-2 if name in rule.sqrt_domain_states else value * 0.1
        for _, state in states:
            state.store(name, value)
    return states


def copy_state(dst: ParamState, src: ParamState):
    dst.load_state_dict({k: v.clone() for k, v in src.state_dict().items()})


def assert_storage_close(ours, ref, what):
    """fp32: 1e-6 relative to the tensor's scale; bf16: within one bf16 step; int8 / fp8: codes within 1
    (fp8 codes as their signed position on the e4m3 grid)."""
    if ours.dtype == torch.float8_e4m3fn:
        ours, ref = fp8_ordinal(ours), fp8_ordinal(ref)
    if ours.dtype in (torch.int8, torch.int32):
        assert (ours.int() - ref.int()).abs().max().item() <= 1, what
        assert (ours != ref).float().mean().item() < 0.01, what
    elif ours.dtype == torch.bfloat16:
        ours32, ref32 = ours.float(), ref.float()
        # one bf16 step of the larger of the two, plus a floor for values that cancel to ~0
        step = torch.maximum(ours32.abs(), ref32.abs()) * 2.0 ** -7 + 1e-6 * ref32.abs().max()
        assert torch.all((ours32 - ref32).abs() <= step * 1.01), what
        assert (ours32 != ref32).float().mean().item() < 0.02, what
    else:
        scale = ref.abs().max().item()
        assert (ours - ref).abs().max().item() <= 1e-6 * scale + 1e-12, what


def fp8_ordinal(codes):
    """float8_e4m3fn codes as their signed position on the fp8 grid (neighbouring values one apart)."""
    bits = codes.view(torch.uint8).int()
    magnitude = bits & 0x7F
    return torch.where(bits >= 0x80, -magnitude, magnitude)
