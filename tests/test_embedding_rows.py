"""The row-gradient embedding (``forge_core.embedding``, ``kernels.row_gradient``, ``kernels.row_update``):
the Triton segment sum against its torch spec, which embeddings ``fuse`` converts, and the row-gradient
step (one ``row_update`` pass through the slot table) against the dense-gradient step it replaces (bit
for bit), with padding, repeated ids, micro-batches, ``zero_grad``, a weight also read outside its
embedding, every rule and state format, stochastic rounding, capturable mode, the slot table's reuse
and ``unfuse``."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import forge_core
from forge_core.embedding import ForgeEmbedding, row_gradient_unsupported
from forge_core.kernels.row_gradient import row_gradient, row_gradient_reference
from same_update import assert_same_update

BACKENDS = ["reference", "triton"]
HP = dict(lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
VOCAB, WIDTH = 37, 70
KERNEL_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"        # the CPU runs it interpreted


def _device(backend: str) -> str:
    return "cuda" if backend == "triton" and torch.cuda.is_available() else "cpu"


def _exact_values(shape: tuple[int, ...], seed: int, device: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Multiples of 1/16 in [-2, 2]: any sum of a few of them is exact in bf16 / fp32, whatever the
    order, so a dense backward and the row sum agree bit for bit on any device."""
    generator = torch.Generator().manual_seed(seed)
    return (torch.randint(-32, 33, shape, generator=generator).float() / 16).to(device=device, dtype=dtype)


# ---- the segment sum ------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("padding_idx", [None, 3])
def test_the_kernel_sums_like_its_torch_spec(dtype: torch.dtype, padding_idx) -> None:
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 9, (4, 13), generator=generator).to(KERNEL_DEVICE)   # many repeats, ragged width
    dy = torch.randn(4, 13, WIDTH, generator=generator).to(KERNEL_DEVICE, dtype)
    touched, rows = row_gradient(ids, dy, dtype, padding_idx)
    spec_touched, spec_rows = row_gradient_reference(ids, dy, dtype, padding_idx)
    assert torch.equal(touched, spec_touched) and torch.equal(rows, spec_rows)
    assert rows.dtype == dtype and rows.shape == (ids.numel(), WIDTH)


def test_the_rows_are_the_dense_gradient_rows() -> None:
    ids = torch.tensor([[5, 1, 5, 0], [1, 5, 2, 2]], device=KERNEL_DEVICE)
    dy = _exact_values((2, 4, WIDTH), 2, KERNEL_DEVICE, torch.bfloat16)
    weight = torch.zeros(VOCAB, WIDTH, dtype=torch.bfloat16, device=KERNEL_DEVICE, requires_grad=True)
    F.embedding(ids, weight, padding_idx=2).backward(dy)
    touched, rows = row_gradient(ids, dy, torch.bfloat16, padding_idx=2)
    assert touched.tolist() == [0, 1, 1, 2, 2, 5, 5, 5]
    assert torch.equal(rows, weight.grad[touched])               # repeats: the same summed row each time
    assert not rows[3:5].any()                                    # the padding id gets no gradient


def test_a_single_token_and_a_wide_row() -> None:
    dy = torch.randn(1, 1, 3000, device=KERNEL_DEVICE)
    touched, rows = row_gradient(torch.tensor([[7]], device=KERNEL_DEVICE), dy, torch.float32)
    assert touched.tolist() == [7] and torch.equal(rows, dy.reshape(1, 3000))


def test_bad_ids_are_refused() -> None:
    with pytest.raises(ValueError, match="token ids must be int32 / int64"):
        row_gradient(torch.zeros(3), torch.zeros(3, 4), torch.float32)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="on a CPU machine the tests run the kernel interpreted")
def test_cpu_tensors_are_refused_on_a_gpu_machine() -> None:
    with pytest.raises(RuntimeError, match="tensors on cpu; the Triton kernel needs CUDA"):
        row_gradient(torch.zeros(3, dtype=torch.long), torch.zeros(3, 4), torch.float32)


# ---- which embeddings fuse converts -----------------------------------------------------------

class EmbedLM(nn.Module):
    """An embedding whose output gradient the test sets exactly (``forward`` returns it), and a fused
    Linear on a detached copy (so ``fuse`` has a Linear to fuse)."""

    def __init__(self, padding_idx=None, **embedding_options) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH, padding_idx=padding_idx, **embedding_options)
        self.proj = nn.Linear(WIDTH, WIDTH)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        embedded = self.embed(ids)
        return embedded + 0.0 * self.proj(embedded.detach()).sum()


def _model(device: str, dtype: torch.dtype = torch.float32, **options) -> EmbedLM:
    torch.manual_seed(0)
    return EmbedLM(**options).to(device=device, dtype=dtype)


def _fuse(model: nn.Module, backend: str, **kwargs) -> forge_core.ForgeOptimizer:
    ids = torch.zeros(1, 8, dtype=torch.long, device=next(model.parameters()).device)
    return forge_core.fuse(model, probe_inputs=ids, backend=backend, **{**HP, **kwargs})


@pytest.mark.parametrize("options, reason", [
    (dict(sparse=True), "sparse=True"),
    (dict(max_norm=1.0), "max_norm"),
    (dict(scale_grad_by_freq=True), "scale_grad_by_freq"),
])
def test_embeddings_whose_gradient_is_not_a_row_sum_stay_plain(options, reason) -> None:
    model = _model("cpu", **options)
    assert reason in row_gradient_unsupported(model.embed)
    _fuse(model, "reference")
    assert type(model.embed) is nn.Embedding


def test_a_tied_embedding_stays_plain() -> None:
    model = _model("cpu")
    model.head = nn.Linear(WIDTH, VOCAB, bias=False)
    model.head.weight = model.embed.weight
    opt = _fuse(model, "reference")
    assert type(model.embed) is nn.Embedding and not any(d.records_rows for d in opt._dense)


def test_fuse_converts_a_plain_embedding_and_unfuse_restores_it() -> None:
    model = _model("cpu")
    _fuse(model, "reference")
    assert type(model.embed) is ForgeEmbedding and "forge_row_gradient=True" in repr(model.embed)
    model(torch.tensor([[1, 2]])).sum().backward()
    assert model.embed.weight.grad is None
    with pytest.warns(UserWarning, match="never applied"):
        forge_core.unfuse(model)
    assert type(model.embed) is nn.Embedding 
    kept = _model("cpu")
    _fuse(kept, "reference", embedding_rows=False)
    assert type(kept.embed) is nn.Embedding


def test_fusing_twice_is_refused() -> None:
    model = EmbedLM().to("cpu")
    model.proj = nn.Identity()                           # only the embedding is converted
    with pytest.warns(UserWarning, match="no Linear weight was fused"):
        _fuse(model, "reference")
    with pytest.raises(ValueError, match="'embed' is already a row-gradient embedding of an earlier fuse"):
        _fuse(model, "reference")


# ---- the row-gradient step equals the dense step ------------------------------------------------

def _steps(model: nn.Module, opt: torch.optim.Optimizer, batches, micro_batches: int = 1) -> None:
    for step, ids in enumerate(batches):
        for micro in range(micro_batches):
            out = model(ids)
            out.backward(_exact_values(tuple(out.shape), 100 * step + micro, str(ids.device), out.dtype))
        opt.step()
        opt.zero_grad()


def _batches(device: str, count: int = 3) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(5)
    return [torch.randint(0, 20, (2, 9), generator=generator).to(device) for _ in range(count)]


def _assert_same_training(rows_model, rows_opt, dense_model, dense_opt) -> None:
    """Bit for bit on the CPU; on the GPU to an ulp (``assert_same_update``)."""
    exact = rows_model.embed.weight.device.type == "cpu"

    def same(ours: torch.Tensor, theirs: torch.Tensor, what: str) -> None:
        assert_same_update(ours, theirs, what, exact)

    same(rows_model.embed.weight, dense_model.embed.weight, "weight")
    ours, theirs = rows_opt._dense[0].state, dense_opt._dense[0].state
    for name in ours.values:
        same(ours.values[name], theirs.values[name], name)
        if ours.scales[name] is not None:
            same(ours.scales[name], theirs.scales[name], name + " scales")
    assert rows_opt._dense[0].steps_done == dense_opt._dense[0].steps_done


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("state_dtype, dtype", [("fp32", torch.float32), ("bf16", torch.bfloat16),
                                                ("int8", torch.bfloat16)])
def test_the_row_step_equals_the_dense_step(backend: str, state_dtype: str, dtype: torch.dtype) -> None:
    device = _device(backend)
    rows_model = _model(device, dtype, padding_idx=4)
    dense_model = copy.deepcopy(rows_model)
    rows_opt = _fuse(rows_model, backend, state_dtype=state_dtype)
    dense_opt = _fuse(dense_model, backend, state_dtype=state_dtype, embedding_rows=False)
    assert rows_opt._dense[0].records_rows and not dense_opt._dense[0].records_rows
    batches = _batches(device)
    batches[0][0, :3] = 4                                           # padding tokens: no gradient, still decay
    _steps(rows_model, rows_opt, batches)
    _steps(dense_model, dense_opt, batches)
    _assert_same_training(rows_model, rows_opt, dense_model, dense_opt)
    assert rows_model.embed.weight.grad is None
    embedding_bytes = rows_model.embed.weight.numel() * rows_model.embed.weight.element_size()
    slot_bytes = 4 * VOCAB if backend == "triton" else 0             # the slot table replaces the dense .grad
    assert (dense_opt.memory_breakdown()["gradients"] - rows_opt.memory_breakdown()["gradients"]) == \
        embedding_bytes - slot_bytes


def _trained_pair(backend: str, dtype: torch.dtype = torch.bfloat16, count: int = 3, **fuse_options):
    """A row-gradient and a dense-gradient copy of one model, trained on the same batches (with
    padding tokens); returns both (model, optimizer) pairs."""
    device = _device(backend)
    rows_model = _model(device, dtype, padding_idx=4)
    dense_model = copy.deepcopy(rows_model)
    rows_opt = _fuse(rows_model, backend, **fuse_options)
    dense_opt = _fuse(dense_model, backend, embedding_rows=False, **fuse_options)
    batches = _batches(device, count)
    batches[0][0, :3] = 4
    _steps(rows_model, rows_opt, batches)
    _steps(dense_model, dense_opt, batches)
    return rows_model, rows_opt, dense_model, dense_opt


RULE_OPTIONS = {"lion": dict(optimizer="lion", lr=1e-3, betas=(0.9, 0.99)),
                "sgd": dict(optimizer="sgd", lr=5e-2, betas=None, momentum=0.9, nesterov=True)}   # None: unset


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("rule", sorted(RULE_OPTIONS))
@pytest.mark.parametrize("state_dtype", ["bf16", "int8"])
def test_other_rules_step_rows_like_the_dense_step(backend: str, rule: str, state_dtype: str) -> None:
    _assert_same_training(*_trained_pair(backend, state_dtype=state_dtype, **RULE_OPTIONS[rule]))


@pytest.mark.parametrize("state_dtype", ["bf16", "int8"])
def test_stochastic_rounding_uses_the_dense_steps_seed(state_dtype: str) -> None:
    """Same seed and same per-element stream as the dense step: the rounding noise matches bit for bit."""
    _assert_same_training(*_trained_pair("triton", state_dtype=state_dtype, stochastic_rounding=True))


@pytest.mark.parametrize("state_dtype", ["fp32", "int8"])
def test_capturable_row_steps_equal_capturable_dense_steps(state_dtype: str) -> None:
    """Device scalars (``capturable=True``), eagerly: on the CPU the interpreter reads them from memory."""
    _assert_same_training(*_trained_pair("triton", torch.float32 if state_dtype == "fp32" else torch.bfloat16,
                                         state_dtype=state_dtype, capturable=True))


def test_the_slot_table_is_one_buffer_rewritten_every_step() -> None:
    device = _device("triton")
    model = _model(device, padding_idx=4)
    opt = _fuse(model, "triton")
    dense = opt._dense[0]
    assert dense.slots is not None and dense.slots.shape == (dense.weight.shape[0],)   # made at fuse: a compiled
    # backward names it among the tensors its row update writes (forge_core.traced)
    tables = []
    for ids in (torch.tensor([[3, 7, 7, 1]]), torch.tensor([[5, 5, 5, 5, 5, 2, 9, 4, 0]]), torch.tensor([[11]])):
        ids = ids.to(device)
        model(ids).sum().backward()
        opt.step()
        tables.append((dense.slots, dense.slots.data_ptr()))
        sorted_ids = torch.sort(ids.reshape(-1)).values
        slots = dense.slots.cpu()
        touched = slots >= 0
        assert set(torch.nonzero(touched).reshape(-1).tolist()) == set(sorted_ids.tolist())
        assert torch.equal(sorted_ids.cpu()[slots[touched].long()], torch.nonzero(touched).reshape(-1))
    assert all(table is tables[0][0] and pointer == tables[0][1] for table, pointer in tables)
    assert dense.slots.dtype == torch.int32 and dense.slots.shape == (VOCAB,)


@pytest.mark.parametrize("backend", BACKENDS)
def test_micro_batches_add_up_and_zero_grad_drops_rows(backend: str) -> None:
    device = _device(backend)
    rows_model = _model(device)
    dense_model = copy.deepcopy(rows_model)
    rows_opt = _fuse(rows_model, backend, accumulate_steps=2)
    dense_opt = _fuse(dense_model, backend, accumulate_steps=2, embedding_rows=False)
    for model, opt in ((rows_model, rows_opt), (dense_model, dense_opt)):
        model.embed(torch.tensor([[3, 3]], device=device)).sum().backward()
        opt.zero_grad()                                             # this backward must not count
    batches = _batches(device, 2)
    _steps(rows_model, rows_opt, batches, micro_batches=2)
    _steps(dense_model, dense_opt, batches, micro_batches=2)
    _assert_same_training(rows_model, rows_opt, dense_model, dense_opt)


class ReadsWeightToo(EmbedLM):
    """Uses ``embed.weight`` directly as well (an untied head reading the tensor): the weight gets a
    ``.grad`` beside the recorded rows, and the step must add both."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        embedded = self.embed(ids)
        return embedded + 0.25 * self.embed.weight.sum(0)          # every row gets a dense gradient


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_weight_read_outside_its_embedding_gets_both_gradients(backend: str) -> None:
    device = _device(backend)
    torch.manual_seed(0)
    rows_model = ReadsWeightToo(padding_idx=4).to(device)
    dense_model = copy.deepcopy(rows_model)
    rows_opt = _fuse(rows_model, backend)
    dense_opt = _fuse(dense_model, backend, embedding_rows=False)
    batches = _batches(device, 2)
    batches[0][0, :3] = 4                                           # padding tokens add no gradient here either
    _steps(rows_model, rows_opt, batches)
    _steps(dense_model, dense_opt, batches)
    torch.testing.assert_close(rows_model.embed.weight, dense_model.embed.weight, rtol=1e-5, atol=1e-6)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
@pytest.mark.parametrize("state_dtype", ["bf16", "int8"])
def test_a_captured_row_step_replays_like_eager_dense_steps(state_dtype: str) -> None:
    """forward + backward + step() with the row-gradient embedding, captured once and replayed, equals
    eager steps of the dense-gradient embedding (sort, segment sum, slot table and the row update all
    replay into the same slot-table buffer; the step count advances on the device)."""
    graphed, eager = _model("cuda", torch.bfloat16, padding_idx=4), _model("cuda", torch.bfloat16, padding_idx=4)
    graph_opt = _fuse(graphed, "triton", state_dtype=state_dtype, capturable=True)
    eager_opt = _fuse(eager, "triton", state_dtype=state_dtype, capturable=True, embedding_rows=False)
    assert graph_opt.row_gradient_names() == ["embed.weight"] and eager_opt.row_gradient_names() == []
    batches = _batches("cuda", 7)
    upstream = _exact_values((2, 9, WIDTH), 3, "cuda", torch.bfloat16)

    def train_step(model: nn.Module, opt: torch.optim.Optimizer, ids: torch.Tensor) -> None:
        (model(ids) * upstream).sum().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for ids in batches[:3]:                   # warm-up: tuning, compilation, the slot table
            train_step(graphed, graph_opt, ids)
    torch.cuda.current_stream().wait_stream(side)
    static_ids = batches[3].clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        train_step(graphed, graph_opt, static_ids)
    slot_table = graph_opt._dense[0].slots
    for ids in batches[3:]:
        static_ids.copy_(ids)
        graph.replay()
    assert graph_opt._dense[0].slots is slot_table
    for ids in batches:
        train_step(eager, eager_opt, ids)
    torch.cuda.synchronize()
    assert graph_opt.steps_taken == eager_opt.steps_taken == 7        # syncs the host step counts
    _assert_same_training(graphed, graph_opt, eager, eager_opt)
