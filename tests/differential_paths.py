"""A model with one weight on each fused path, the batches that drive it, and the runs the differential
test (``tests/test_differential.py``) compares: FORGE in each state format against the rule's torch
optimizer with fp32 states.

Each module's output is multiplied by an output gradient drawn for the step and summed, so the loss is
linear in every output: a weight's gradient depends on the step's batch alone, not on the weights
(the experts' gate / up projection excepted: its gradient goes through ``down_proj`` and the gate), and
every run sees the same gradients. What tells two runs apart is then the optimizer state alone.

Paths: ``lin`` (a fused Linear), ``conv`` (a fused GPT-2 Conv1D, ``(Din, Dout)``), ``experts`` (3-D
MoE experts), ``emb_rows`` (an embedding stepped from recorded rows), ``emb_dense`` (an embedding
whose ``scale_grad_by_freq`` keeps it on the dense ``.grad`` path: an ``EmbeddingState``),
``matrix`` (a 2-D Parameter used directly: a dense 2-D weight with a ``ParamState``) and ``tied``
(an embedding tied to a head). The schedules reach some rows, columns and experts only from a later
step and some never: an int8 block then holds values of very different ages side by side.
"""
from __future__ import annotations

import dataclasses
import warnings
from typing import Any

import torch
from torch import nn

import forge_core



@dataclasses.dataclass(frozen=True)
class Dims:
    """The model's sizes: ``width`` the embeddings' and the Linear's input width, ``hidden`` the Linear's and
    Conv1D's output width, ``tokens`` per step."""
    width: int = 80            # 64 + a ragged block of 16
    hidden: int = 40
    vocab: int = 40
    tied_vocab: int = 24
    matrix_rows: int = 20
    experts: int = 4
    expert_width: int = 16
    tokens: int = 12


SMALL = Dims()
GLUON = Dims(width=128, hidden=128, tokens=64)
"""Where the warp-specialized Gluon kernel takes the Linear and Conv1D weights (128 x 128, bf16)."""
LATE_STEP = 3
"""The step from which the late rows, columns and expert are first reached."""
NEVER_ROWS = 4
"""The last rows of each weight (and the last vocabulary ids) no step reaches; the last expert no token."""

RULE_HYPERPARAMETERS: dict[str, dict[str, Any]] = {
    "adamw": dict(lr=1e-3, betas=(0.9, 0.99), weight_decay=0.0),
    "sgd": dict(lr=1e-2, momentum=0.9),
    "lion": dict(lr=1e-3, betas=(0.9, 0.99)),
    "rmsprop": dict(lr=1e-3, alpha=0.99),
    "adagrad": dict(lr=1e-2),
    "adamax": dict(lr=1e-3),
    "nadam": dict(lr=1e-3, betas=(0.9, 0.99)),
    "radam": dict(lr=1e-3, betas=(0.9, 0.99)),
    "lamb": dict(lr=1e-2, weight_decay=0.0),
    "muon": dict(lr=1e-2, weight_decay=0.0),
    "adafactor": dict(lr=1e-2),
    "adalomo": dict(lr=1e-2),
    "sm3": dict(lr=1e-2),
    "adam_mini": dict(lr=1e-3),
    "lars": dict(lr=1e-2),
    "galore_adamw": dict(lr=1e-3, rank=4),
}
"""Each rule's hyper-parameters here: no weight decay (a row no step reaches must then stay where it is
under torch too), the betas of a short run."""
VARIANTS: dict[str, dict[str, Any]] = {
    "adamw": dict(lr=1e-3, betas=(0.8, 0.999), weight_decay=0.1),
    "sgd": dict(lr=1e-2, momentum=0.9, nesterov=True, weight_decay=1e-2),
    "lion": dict(lr=1e-3, weight_decay=0.1),
    "rmsprop": dict(lr=1e-3, alpha=0.9, momentum=0.9, weight_decay=1e-2),
    "adagrad": dict(lr=1e-2, lr_decay=1e-2, initial_accumulator_value=0.1, weight_decay=1e-2),
    "adamax": dict(lr=1e-3, betas=(0.8, 0.99), weight_decay=1e-2),
    "nadam": dict(lr=1e-3, decoupled_weight_decay=True, weight_decay=0.1, momentum_decay=1e-2),
    "radam": dict(lr=1e-3, decoupled_weight_decay=True, weight_decay=0.1),
    "lamb": dict(lr=1e-2, weight_decay=1e-2, trust_clip=True),
}
"""A second setting of each kernel rule for the larger sweep: weight decay, and the options that change its
state set or its arithmetic (Nesterov, RMSprop's momentum, NAdam's decoupled decay, LAMB's clip). Centered
RMSprop (fp32 and bf16 states only) is ``CENTERED``."""
CENTERED = dict(lr=1e-3, alpha=0.9, momentum=0.9, centered=True, weight_decay=1e-2)


def hyperparameters(rule_name: str, variant: str = "") -> dict[str, Any]:
    """The rule's hyper-parameters here: ``RULE_HYPERPARAMETERS``, ``VARIANTS`` for ``variant="variant"``,
    ``CENTERED`` for RMSprop's ``variant="centered"``."""
    if variant == "centered":
        return dict(CENTERED)
    return dict(VARIANTS[rule_name] if variant == "variant" else RULE_HYPERPARAMETERS[rule_name])



def _conv1d(nf: int, nx: int) -> nn.Module:
    from transformers.pytorch_utils import Conv1D
    return Conv1D(nf, nx)


def _experts(dims: Dims) -> nn.Module:
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts
    config = Qwen3MoeConfig(hidden_size=dims.width, moe_intermediate_size=dims.expert_width, num_experts=dims.experts,
                            hidden_act="silu")
    experts = Qwen3MoeExperts(config)
    nn.init.normal_(experts.gate_up_proj, std=0.1)
    nn.init.normal_(experts.down_proj, std=0.1)
    return experts


class Paths(nn.Module):
    """One weight per fused path, each read by its own term of a loss linear in its output (``experts``
    False: no experts module)."""

    def __init__(self, experts: bool = True, dims: Dims = SMALL) -> None:
        super().__init__()
        self.emb_rows = nn.Embedding(dims.vocab, dims.width)
        self.emb_dense = nn.Embedding(dims.vocab, dims.width, scale_grad_by_freq=True)
        self.tied = nn.Embedding(dims.tied_vocab, dims.width)
        self.head = nn.Linear(dims.width, dims.tied_vocab, bias=False)
        self.head.weight = self.tied.weight
        self.matrix = nn.Parameter(torch.randn(dims.matrix_rows, dims.width) * 0.1)
        self.lin = nn.Linear(dims.width, dims.hidden)
        self.conv = _conv1d(dims.hidden, dims.width)
        self.experts = _experts(dims) if experts else None

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        x = batch["x"].to(self.matrix.dtype)
        terms = [
            (self.emb_rows(batch["ids_rows"]), batch["r_emb_rows"]),
            (self.emb_dense(batch["ids_dense"]), batch["r_emb_dense"]),
            (self.tied(batch["ids_tied"]), batch["r_tied"]),
            (self.head(x), batch["r_head"]),
            (x @ self.matrix.t(), batch["r_matrix"]),
            (self.lin(x), batch["r_lin"]),
            (self.conv(x), batch["r_conv"]),
        ]
        if self.experts is not None:
            terms.append((self.experts(x, batch["top_k_index"], batch["top_k_weights"]), batch["r_experts"]))
        return sum((output.float() * target).sum() for output, target in terms)


WEIGHTS = {"emb_rows": "emb_rows.weight", "emb_dense": "emb_dense.weight", "tied": "tied.weight",
           "matrix": "matrix", "lin": "lin.weight", "conv": "conv.weight",
           "experts_gate_up": "experts.gate_up_proj", "experts_down": "experts.down_proj"}
"""Path -> the parameter it steps (the tied weight is the embedding's and the head's)."""


def make_model(seed: int = 0, experts: bool = True, dims: Dims = SMALL,
               dtype: torch.dtype = torch.float32) -> Paths:
    """The model at ``seed`` (drawn in fp32, then cast to ``dtype``)."""
    torch.manual_seed(seed)
    return Paths(experts, dims).to(dtype)


def _reached_columns(size: int, step: int) -> torch.Tensor:
    """1 for the columns (or output rows) a step reaches: the last ``NEVER_ROWS`` never, the quarter before
    them from ``LATE_STEP`` on."""
    mask = torch.ones(size)
    mask[size - NEVER_ROWS:] = 0.0
    if step < LATE_STEP:
        mask[(3 * (size - NEVER_ROWS)) // 4: size - NEVER_ROWS] = 0.0
    return mask


def _ids(generator: torch.Generator, vocab: int, step: int, tokens: int) -> torch.Tensor:
    """A few ids of the rows a step may reach (a new draw each step: most rows are touched, then left idle)."""
    reachable = vocab - NEVER_ROWS if step >= LATE_STEP else (3 * (vocab - NEVER_ROWS)) // 4
    return torch.randint(0, reachable, (tokens,), generator=generator)


def make_batches(steps: int, seed: int = 1, dims: Dims = SMALL) -> list[dict[str, torch.Tensor]]:
    """``steps`` batches on the CPU (the same values on every machine). Input columns span four decades
    (``spread``), so a block's small first moments sit next to large ones."""
    generator = torch.Generator().manual_seed(seed)
    d = dims
    spread = torch.logspace(-3, 0, d.width)[torch.randperm(d.width, generator=generator)]
    batches = []
    for step in range(1, steps + 1):
        def drawn(*shape: int) -> torch.Tensor:
            return torch.randn(*shape, generator=generator)
        x = drawn(d.tokens, d.width) * spread * _reached_columns(d.width, step)
        # experts 0 and 1 from the first step, the one before the last from LATE_STEP, the last never
        experts = torch.tensor([0, 1] + ([d.experts - 2] if step >= LATE_STEP else []))
        top_k_index = experts[torch.randint(0, experts.numel(), (d.tokens, 1), generator=generator)]
        batches.append({
            "x": x, "ids_rows": _ids(generator, d.vocab, step, d.tokens),
            "ids_dense": _ids(generator, d.vocab, step, d.tokens),
            "ids_tied": _ids(generator, d.tied_vocab, step, d.tokens),
            "r_emb_rows": drawn(d.tokens, d.width) * spread, "r_emb_dense": drawn(d.tokens, d.width) * spread,
            "r_tied": drawn(d.tokens, d.width) * spread,
            "r_head": drawn(d.tokens, d.tied_vocab) * _reached_columns(d.tied_vocab, step),
            "r_matrix": drawn(d.tokens, d.matrix_rows) * _reached_columns(d.matrix_rows, step),
            "r_lin": drawn(d.tokens, d.hidden) * _reached_columns(d.hidden, step),
            "r_conv": drawn(d.tokens, d.hidden) * _reached_columns(d.hidden, step),
            "r_experts": drawn(d.tokens, d.width) * _reached_columns(d.width, step),
            "top_k_index": top_k_index, "top_k_weights": torch.ones(d.tokens, 1),
        })
    return batches


def to_device(batch: dict[str, torch.Tensor], device: str) -> dict[str, torch.Tensor]:
    return {key: value.to(device) for key, value in batch.items()}


def torch_optimizer(rule_name: str, model: nn.Module, hp: dict[str, Any]) -> Any:
    """The rule's torch optimizer with fp32 states over every trainable parameter: torch.optim's class of
    the same name (Lion, LAMB: forge_core's; Muon: torch.optim.Muon on the 2-D weights FORGE steps with
    Muon, AdamW on the rest; the regime-3 rules torch has no class for: their reference, GaLore's without a
    projection but for the hidden weights)."""
    rule = forge_core.get_rule(rule_name)
    params = [p for p in model.parameters() if p.requires_grad]
    if rule_name == "muon":
        from forge_core.rules.muon import adamw_hyperparameters
        muon_ids = {id(model.lin.weight), id(model.conv.weight)}
        muon_hp = {key: value for key, value in rule.resolve_hp(hp).items() if not key.startswith("adamw_")}
        return _Chain([torch.optim.Muon([p for p in params if id(p) in muon_ids], **muon_hp),
                       torch.optim.AdamW([p for p in params if id(p) not in muon_ids],
                                         **adamw_hyperparameters(rule.resolve_hp(hp)))])
    if rule.regime == 3 and rule_name != "adafactor":
        from forge_core.rules.rule_optimizer import RuleOptimizer
        names = {id(p): n for n, p in model.named_parameters()}
        if rule_name != "galore_adamw":
            return RuleOptimizer(params, rule, parameter_names=names, **hp)
        hidden = {id(model.lin.weight), id(model.conv.weight)}    # GaLore's recipes project hidden weights only
        return RuleOptimizer([{"params": [p for p in params if id(p) in hidden]},
                              {"params": [p for p in params if id(p) not in hidden], "rank": 0}],
                             rule, parameter_names=names, **hp)
    extra = {"foreach": False} if rule_name not in ("lion", "lamb") and rule.regime != 3 else {}
    return rule.fallback_optimizer(params, **hp, **extra)


class _Chain:
    """Optimizers stepped as one (torch.optim.Muon's documentation pairs it with AdamW)."""

    def __init__(self, optimizers: list[torch.optim.Optimizer]) -> None:
        self.optimizers = optimizers

    def step(self) -> None:
        for optimizer in self.optimizers:
            optimizer.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for optimizer in self.optimizers:
            optimizer.zero_grad(set_to_none=set_to_none)


@dataclasses.dataclass
class Run:
    """Each path's weight after every step (index 0: as initialised), in fp32 on the CPU."""
    weights: dict[str, list[torch.Tensor]]
    how: dict[str, str]
    """Path -> how it was stepped: "fused", "rows", "dense" or "fallback" (FORGE), "torch"."""


def _snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    parameters = dict(model.named_parameters(remove_duplicate=False))
    return {path: parameters[name].detach().float().cpu().clone() for path, name in WEIGHTS.items()
            if name in parameters}


def run(model: nn.Module, optimizer: Any, batches: list[dict[str, torch.Tensor]],
        device: str) -> dict[str, list[torch.Tensor]]:
    """Step ``optimizer`` once per batch; each path's weight before the first step and after each."""
    weights = {path: [value] for path, value in _snapshot(model).items()}
    for batch in batches:
        model(to_device(batch, device)).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        for path, value in _snapshot(model).items():
            weights[path].append(value)
    return weights


def torch_run(rule_name: str, batches: list[dict[str, torch.Tensor]], device: str = "cpu",
              experts: bool = True, dims: Dims = SMALL, variant: str = "") -> Run:
    model = make_model(experts=experts, dims=dims).to(device)
    weights = run(model, torch_optimizer(rule_name, model, hyperparameters(rule_name, variant)), batches, device)
    return Run(weights, {path: "torch" for path in weights})


def how_stepped(optimizer: forge_core.ForgeOptimizer, model: nn.Module) -> dict[str, str]:
    parameters = dict(model.named_parameters(remove_duplicate=False))
    fused = {id(p) for p in optimizer.fused_parameters()}
    dense = {id(d.weight): ("rows" if d.records_rows else "dense") for d in optimizer.dense_weights()}
    out = {}
    for path, name in WEIGHTS.items():
        if name not in parameters:
            continue
        parameter = parameters[name]
        out[path] = "fused" if id(parameter) in fused else dense.get(id(parameter), "fallback")
    return out


def forge_run(rule_name: str, state_dtype: str, batches: list[dict[str, torch.Tensor]], *, backend: str,
              device: str = "cpu", embedding_rows: bool = True, experts: bool = True, dims: Dims = SMALL,
              dtype: torch.dtype = torch.float32, variant: str = "") -> Run:
    model = make_model(experts=experts, dims=dims, dtype=dtype).to(device)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")          # the per-layer rules leave experts to their fallback, loudly
        optimizer = forge_core.fuse(model, rule_name, state_dtype=state_dtype, backend=backend, probe_inputs=False,
                                    embedding_rows=embedding_rows, **hyperparameters(rule_name, variant))
    weights = run(model, optimizer, batches, device)
    return Run(weights, how_stepped(optimizer, model))



# -- what each rule bounds a step by ---------------------------------------------------------------

def _adam_ratio_bound(beta1: float, beta2: float, step: int) -> float:
    """The largest ``|m_hat| / sqrt(v_hat)`` Adam's moments allow after ``step`` steps, for any gradients
    (Cauchy-Schwarz over the two exponential sums): 1 at step 1."""
    q = beta1 * beta1 / beta2
    return ((1 - beta1) / (1 - beta1 ** step) * ((1 - beta2 ** step) / (1 - beta2)) ** 0.5
            * ((1 - q ** step) / (1 - q)) ** 0.5)


def element_bound(rule_name: str, hp: dict[str, Any], step: int) -> float | None:
    """The largest move of one element at step ``step`` the rule allows for any gradient (no weight decay),
    or None where the move is the gradient's size (SGD, RAdam before rho_t > 5, centered RMSprop)."""
    full = forge_core.get_rule(rule_name).resolve_hp(hp)
    lr = float(full["lr"])
    if rule_name in ("adamw", "lion", "adagrad"):
        return lr * (_adam_ratio_bound(*full["betas"], step) if rule_name == "adamw" else 1.0)
    if rule_name == "adamax":
        beta1, beta2 = full["betas"]
        return lr * (1 - beta1) / (1 - beta1 ** step) * (1 - (beta1 / beta2) ** step) / (1 - beta1 / beta2)
    if rule_name == "rmsprop":
        if full["centered"]:
            return None
        momentum = float(full["momentum"])
        steps = sum(momentum ** k for k in range(step)) if momentum else 1.0
        return lr * steps / (1 - float(full["alpha"])) ** 0.5
    if rule_name == "nadam":
        from forge_core.rules.nadam import mu, mu_product
        beta1, beta2 = full["betas"]
        decay = float(full["momentum_decay"])
        gradient = ((1 - beta2 ** step) / (1 - beta2)) ** 0.5           # |g| / sqrt(v_hat)
        moment = _adam_ratio_bound(beta1, beta2, step) * (1 - beta1 ** step)     # |m| / sqrt(v_hat)
        mu_now, mu_next = mu(beta1, decay, step), mu(beta1, decay, step + 1)
        product = mu_product(beta1, decay, step)
        return lr * ((1 - mu_now) / (1 - product) * gradient + mu_next / (1 - product * mu_next) * moment)
    if rule_name == "radam":
        from forge_core.rules.radam import rho
        beta1, beta2 = full["betas"]
        rho_inf, rho_t = rho(beta2, step)
        if rho_t <= 5.0:
            return None
        rect = ((rho_t - 4) * (rho_t - 2) * rho_inf / ((rho_inf - 4) * (rho_inf - 2) * rho_t)) ** 0.5
        return lr * rect * _adam_ratio_bound(beta1, beta2, step)
    return None


def move_ratio(rule_name: str, hp: dict[str, Any], step: int, before: torch.Tensor, after: torch.Tensor,
               weight_precision: float = 2.0 ** -23) -> float | None:
    """A step's move from ``before`` to ``after`` over the rule's bound on it (at most 1 within the bound),
    or None where the rule bounds nothing. Element-wise rules: the largest element's move. LAMB: the
    Frobenius norm of the move over ``lr * ||W||`` (its trust ratio makes them equal). Adafactor: the
    move's rms over ``d * max(eps2, rms(W)) * min(lr, step^-0.5)``. Muon: the spectral norm over its
    adjusted lr (torch's bf16 Newton-Schulz leaves singular values below 1.25: 1.204 seen). An element's move
    is counted less the rounding of its stored weight (``weight_precision``, relative: an fp32 ulp, torch adds
    two terms to NAdam's) and less its weight decay (``lr * weight_decay * |w|``, which the rules add)."""
    full = forge_core.get_rule(rule_name).resolve_hp(hp)
    lr = float(full["lr"])
    move = (after - before).double()
    bound = element_bound(rule_name, hp, step)
    if bound is not None:
        rounding = torch.maximum(before.abs(), after.abs()).double() * weight_precision
        decay = before.abs().double() * lr * float(full.get("weight_decay", 0.0))
        return float((move.abs() - rounding - decay).max()) / bound
    if rule_name == "lamb":
        norm = float(before.double().norm())
        return float(move.norm()) / (lr * norm) if norm > 0 else None
    if rule_name == "adafactor":
        d, eps2 = float(full["d"]), float(full["eps"][1])
        rms = float(before.double().square().mean().sqrt())
        return float(move.square().mean().sqrt()) / (d * max(eps2, rms) * min(lr, step ** -0.5))
    if rule_name == "muon":
        from forge_core.newton_schulz import adjusted_lr
        adjusted = adjusted_lr(lr, full["adjust_lr_fn"], before.shape)
        return float(torch.linalg.matrix_norm(move, ord=2)) / (1.25 * adjusted)
    return None
