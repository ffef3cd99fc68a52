"""Suite files: validation errors name file + field + expectation; grids expand as documented."""
from __future__ import annotations

from pathlib import Path

import pytest

from forge_bench import suite as suite_mod
from forge_bench.methods import METHODS
from forge_bench.suite import SuiteError, load_suite, select_cells

REPO = Path(__file__).resolve().parent.parent
# the suites in the repository, and the smoke suite shipped inside the package (the default)
SHIPPED = sorted((REPO / "suites").glob("*.yaml")) + sorted((REPO / "forge_bench" / "suites").glob("*.yaml"))

GOOD = """
device: cpu
dtype: float32
models: [tiny-llama]
batch: [1, 2]
seq: [16, 32]
methods: [no_optimizer, sgd]
"""


def write(tmp_path: Path, text: str, name: str = "s.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def error_of(tmp_path: Path, text: str) -> str:
    path = write(tmp_path, text)
    with pytest.raises(SuiteError) as info:
        load_suite(path)
    message = str(info.value)
    assert "\n" not in message, "errors must be one line"
    assert message.startswith(f"{path}: "), "errors must name the file"
    return message


def test_one_grid_shorthand_expands_in_documented_order(tmp_path):
    s = load_suite(write(tmp_path, GOOD))
    labels = [c.label for c in s.cells]
    assert labels == [f"main/tiny-llama/b{b}/s{q}/{m}" for b in (1, 2) for q in (16, 32) for m in ("no_optimizer", "sgd")]
    assert len({c.cell_id for c in s.cells}) == 8
    assert s.spec.warmup_steps == suite_mod.DEFAULT_WARMUP["cpu"]
    assert s.spec.timed_steps == 20 and s.spec.repeats == 3 and s.spec.parity.steps == 20
    # ids are stable across loads and change when the suite file changes
    assert [c.cell_id for c in load_suite(tmp_path / "s.yaml").cells] == [c.cell_id for c in s.cells]
    other = load_suite(write(tmp_path, GOOD + "timed_steps: 5\n", "t.yaml"))
    assert not {c.cell_id for c in other.cells} & {c.cell_id for c in s.cells}


def test_a_grid_sets_its_cells_repeats_and_the_others_keep_the_suites(tmp_path):
    s = load_suite(write(tmp_path, """
device: cuda
repeats: 3
grids:
  - {name: host_bound, models: [llama-3.2-1b], batch: [1], seq: [512], repeats: 9, methods: [adamw_fused]}
  - {name: plain, models: [llama-3.1-8b], batch: [1], seq: [512], methods: [adamw_fused]}
"""))
    assert {c.grid: c.timed_repeats(s.spec) for c in s.cells} == {"host_bound": 9, "plain": 3}
    message = error_of(tmp_path, "device: cpu\ngrids:\n  - {name: g, models: [tiny-llama], batch: [1], seq: [16], "
                                 "repeats: 0, methods: [sgd]}\n")
    assert "repeats" in message and "greater than or equal to 1" in message


def test_grids_dedupe_shared_cells_and_only_selects(tmp_path):
    text = """
device: cuda
grids:
  - {name: headline, models: [llama-3.1-8b], batch: [1], seq: [512], methods: [adamw_fused, forge_bf16]}
  - {name: shapes, models: [llama-3.1-8b], batch: [1, 2], seq: [512, 1024], methods: [adamw_fused, forge_bf16]}
"""
    s = load_suite(write(tmp_path, text))
    assert len(s.cells) == 8                        # the headline cell is not run twice
    assert s.spec.warmup_steps == 30                # GPU default
    head = select_cells(s.cells, "headline")
    assert [c.label for c in head] == ["headline/llama-3.1-8b/b1/s512/adamw_fused", "headline/llama-3.1-8b/b1/s512/forge_bf16"]
    assert len(select_cells(s.cells, "*/b2/*")) == 4
    assert len(select_cells(s.cells, "*/forge_bf16,*/b1/s512/*")) == 5
    assert select_cells(s.cells, "nothing-like-this") == []
    assert select_cells(s.cells, None) == list(s.cells)


def test_malformed_yaml(tmp_path):
    msg = error_of(tmp_path, "device: cpu\nmodels: [tiny-llama\nbatch: [1]\n")
    assert "not valid YAML" in msg and "line" in msg


def test_top_level_not_a_mapping(tmp_path):
    assert "expected a mapping" in error_of(tmp_path, "- a\n- b\n")


def test_unknown_model_lists_known_ones(tmp_path):
    msg = error_of(tmp_path, GOOD.replace("[tiny-llama]", "[llama-9000]"))
    assert "models: unknown model" in msg and "'llama-9000'" in msg and "llama-3.1-8b" in msg and "tiny-gpt2" in msg


def test_unknown_method_lists_known_ones(tmp_path):
    msg = error_of(tmp_path, GOOD.replace("no_optimizer, sgd", "no_optimizer, adamw_magic"))
    assert "methods: unknown method" in msg and "'adamw_magic'" in msg
    assert all(name in msg for name in ("adamw_fused", "forge_int8", "sgd"))


def test_a_thousand_wide_grid_error_names_a_few_values_and_counts_the_rest(tmp_path):
    """A 1000 x 1000 grid with bad values: the one-line error shows eight of them and how many more."""
    numbers = ", ".join(str(n) for n in range(1, 1001))
    negative = ", ".join(str(-n) for n in range(1, 1001))
    path = write(tmp_path, GOOD.replace("batch: [1, 2]", f"batch: [{numbers}]").replace("seq: [16, 32]",
                                                                                         f"seq: [{negative}]"))
    msg = error_of(tmp_path, path.read_text())
    assert msg == (f"{path}: seq: expected positive integers, got [-1, -2, -3, -4, -5, -6, -7, -8, ... (992 more)]")
    longer = ", ".join(str(n) for n in range(1, 2001, 2))
    msg = error_of(tmp_path, GOOD.replace("batch: [1, 2]", f"batch: [{numbers}]").replace("seq: [16, 32]",
                                                                                          f"seq: [{longer}]"))
    assert msg.endswith("seq [1025, 1027, 1029, 1031, 1033, 1035, 1037, 1039, ... (480 more)] too long for "
                        "model 'tiny-llama' (at most 1024 tokens)") and len(msg) < 250
    msg = error_of(tmp_path, GOOD.replace("seq: [16, 32]", "seq: " + str(["x" * 200] * 1000)))
    assert len(msg) < 400 and msg.endswith(f"(got '{'x' * 36}...) (and 997 more)")


def test_wrong_types(tmp_path):
    msg = error_of(tmp_path, GOOD.replace("batch: [1, 2]", "batch: [1, two]"))
    assert "batch[1]: " in msg and "grids" not in msg and "integer" in msg and "'two'" in msg
    msg = error_of(tmp_path, GOOD + "repeats: many\n")
    assert "repeats" in msg and "integer" in msg
    msg = error_of(tmp_path, GOOD + "parity: {enabled: maybe}\n")
    assert "parity.enabled" in msg and "boolean" in msg
    msg = error_of(tmp_path, GOOD.replace("dtype: float32", "dtype: float8"))
    assert "dtype" in msg and "bfloat16" in msg
    msg = error_of(tmp_path, GOOD.replace("batch: [1, 2]", "batch: [0]"))
    assert "positive" in msg


def test_unknown_field_and_missing_field(tmp_path):
    assert "timed_stpes: unknown field" in error_of(tmp_path, GOOD + "timed_stpes: 3\n")
    msg = error_of(tmp_path, "device: cpu\ngrids:\n  - {name: a, models: [tiny-llama], batch: [1], seq: [8]}\n")
    assert "grids[0].methods" in msg and "missing" in msg
    assert "grids" in error_of(tmp_path, "device: cpu\n")


def test_seq_longer_than_the_model_allows(tmp_path):
    msg = error_of(tmp_path, GOOD.replace("[tiny-llama]", "[gpt2-xl]").replace("seq: [16, 32]", "seq: [2048]"))
    assert "gpt2-xl" in msg and "1024" in msg


def test_bad_device_and_missing_file(tmp_path):
    assert "device" in error_of(tmp_path, GOOD.replace("device: cpu", "device: tpu"))
    with pytest.raises(SuiteError, match="cannot read suite file"):
        load_suite(tmp_path / "nope.yaml")


@pytest.mark.parametrize("path", SHIPPED, ids=[p.name for p in SHIPPED])
def test_shipped_suites_validate(path):
    s = load_suite(path)
    assert s.cells
    assert all(c.method in METHODS for c in s.cells)


def test_shipped_suite_set_and_default():
    names = {p.name for p in SHIPPED}
    assert {"smoke.yaml", "h100_llama8b.yaml", "h200_llama8b.yaml", "models.yaml", "gpu_smoke.yaml"} <= names
    packaged = suite_mod.default_suite_path()
    assert packaged == REPO / "forge_bench" / "suites" / "smoke.yaml" and packaged.is_file()
    assert [p.name for p in SHIPPED].count("smoke.yaml") == 1, "one copy of the smoke suite: the packaged default"
    smoke = load_suite(None)
    assert smoke.spec.device == "cpu"
    methods = {c.method for c in smoke.cells}
    assert {"forge_fp32", "forge_bf16", "forge_int8", "no_optimizer", "adamw_foreach", "sgd"} <= methods
    assert all(METHODS[m].unavailable_reason("cpu") is None or METHODS[m].family == "forge" for m in methods)


@pytest.mark.parametrize("name", ["h100_llama8b.yaml", "h200_llama8b.yaml"])
def test_headline_cell_runs_alone_with_every_arm(name):
    s = load_suite(REPO / "suites" / name)
    head = select_cells(s.cells, "headline")
    assert {(c.model, c.batch, c.seq) for c in head} == {("llama-3.1-8b", 1, 512)}
    core = {"no_optimizer", "adamw_foreach", "adamw_fused", "sgd", "forge_fp32", "forge_bf16", "forge_int8", "forge_fp8"}
    assert {c.method for c in select_cells(s.cells, "headline/*")} == core
    peers = {name for name, m in METHODS.items() if m.family == "peer" and not name.startswith("test_")}
    # the A/B arms of two FORGE options (side-stream overlap off; the chunked LM-head loss), graphed only
    new = {"forge_bf16_side_stream", "forge_int8_side_stream", "forge_bf16_cce", "forge_int8_cce", "adamw_fused_cce", "forge_fp8_cce"}
    assert {c.method for c in select_cells(s.cells, "headline_graph_new/*")} == new
    # the compiled twins of the core arms (forge_bench/compiled_arms.py), and of the chunked-loss arms under
    # reduce-overhead with lean activations
    compiled = {f"{arm}_{suffix}" for arm in ("adamw_fused", "forge_bf16", "forge_int8") for suffix in ("compile", "compile_ro")}
    compiled |= {"forge_bf16_cce_compile_ro", "forge_int8_cce_compile_ro"}
    assert {c.method for c in select_cells(s.cells, "headline_compile*/*")} == compiled
    assert all(METHODS[name].compile_mode is not None for name in compiled)
    assert {c.method for c in head} == core | peers | new | compiled, "every registered arm runs at the headline shape"
    shapes = {(c.batch, c.seq) for c in s.cells if c.model == "llama-3.1-8b"}
    assert {(b, q) for b in (1, 2, 4) for q in (512, 1024, 2048)} <= shapes
    assert s.spec.device == "cuda" and s.spec.dtype == "bfloat16"


def test_models_suite_covers_the_zoo():
    s = load_suite(REPO / "suites" / "models.yaml")
    assert {c.model for c in s.cells} == {"llama-3.2-1b", "llama-3.2-3b", "llama-3.1-8b", "qwen2.5-7b",
                                          "mistral-7b", "gpt2-xl"}


def test_cuda_graph_grids_get_their_own_cells_and_eager_ids_do_not_move(tmp_path):
    text = """
device: cuda
grids:
  - {name: eager, models: [llama-3.1-8b], batch: [1], seq: [512], methods: [adamw_fused, forge_bf16]}
  - {name: graph, models: [llama-3.1-8b], batch: [1], seq: [512], methods: [adamw_fused, forge_bf16], cuda_graph: true}
"""
    s = load_suite(write(tmp_path, text))
    assert len(s.cells) == 4
    eager = [c for c in s.cells if not c.cuda_graph]
    graph = [c for c in s.cells if c.cuda_graph]
    assert [c.grid for c in graph] == ["graph", "graph"] and all("_graph_" in c.cell_id for c in graph)
    for c in eager:   # an eager cell's id carries no graph mark: the same as in a suite without graph grids
        assert c.cell_id == suite_mod.make_cell_id(s.sha256, c.model, c.batch, c.seq, c.method, c.dtype, c.device)
    assert s.spec.train_config(cuda_graph=True).capturable and not s.spec.train_config().capturable


def test_cuda_graph_needs_a_cuda_suite(tmp_path):
    message = error_of(tmp_path, GOOD.replace("methods: [no_optimizer, sgd]", "methods: [no_optimizer, sgd]\n")
                       .replace("models: [tiny-llama]", "grids:\n  - {name: g, models: [tiny-llama], batch: [1], "
                                "seq: [16], methods: [sgd], cuda_graph: true}")
                       .replace("batch: [1, 2]\n", "").replace("seq: [16, 32]\n", "")
                       .replace("methods: [no_optimizer, sgd]\n", ""))
    assert "cuda_graph needs device cuda" in message and "'g'" in message


def test_lean_grids_get_their_own_cells_and_hf_ids_do_not_move(tmp_path):
    text = """
device: cuda
grids:
  - {name: hf, models: [llama-3.1-8b], batch: [1], seq: [512], methods: [adamw_fused, forge_bf16], cuda_graph: true}
  - {name: lean, models: [llama-3.1-8b], batch: [1], seq: [512], methods: [adamw_fused, forge_bf16], cuda_graph: true,
     activations: lean}
"""
    s = load_suite(write(tmp_path, text))
    assert len(s.cells) == 4
    lean = [c for c in s.cells if c.activations == "lean"]
    assert [c.grid for c in lean] == ["lean", "lean"] and all("_graph_lean_" in c.cell_id for c in lean)
    for c in s.cells:
        if c.activations == "hf":
            assert c.cell_id == suite_mod.make_cell_id(s.sha256, c.model, c.batch, c.seq, c.method, c.dtype, c.device,
                                                       True)


def test_lean_activations_need_llama_style_blocks(tmp_path):
    text = """
device: cuda
grids:
  - {name: g, models: [llama-3.1-8b, gpt2-xl], batch: [1], seq: [512], methods: [adamw_fused], activations: lean}
"""
    with pytest.raises(suite_mod.SuiteError) as err:
        load_suite(write(tmp_path, text))
    message = str(err.value)
    assert "activations: lean needs Llama-style blocks" in message and "'gpt2-xl'" in message
    assert "llama-3.1-8b" not in message.split("needs")[1]
    bad = text.replace("activations: lean", "activations: slim").replace("llama-3.1-8b, gpt2-xl", "llama-3.1-8b")
    with pytest.raises(suite_mod.SuiteError, match="activations"):
        load_suite(write(tmp_path, bad))


@pytest.mark.parametrize("change, field, got", [
    (("batch: [1, 2]", "batch: [true]"), "batch[0]", "True"),
    (("seq: [16, 32]", 'seq: ["16"]'), "seq[0]", "'16'"),
    (("dtype: float32", "dtype: float32\ntimed_steps: 2.5"), "timed_steps", "2.5"),
    (("dtype: float32", "dtype: float32\ntimeout_s: yes"), "timeout_s", "True"),
    (("dtype: float32", "dtype: float32\noptimizer: {betas: [0.9, '0.95']}"), "optimizer.betas[1]", "'0.95'"),
    (("dtype: float32", "dtype: float32\nparity: {enabled: 1}"), "parity.enabled", "1"),
])
def test_a_number_or_flag_field_takes_only_its_own_type(tmp_path, change, field, got):
    """No coercion: YAML's `true` or a quoted "16" where a number belongs is an error naming the field."""
    msg = error_of(tmp_path, GOOD.replace(*change))
    assert f": {field}: " in msg and f"(got {got})" in msg


def test_yaml_1_2_exponents_are_numbers(tmp_path):
    s = load_suite(write(tmp_path, GOOD + "optimizer: {lr: 3e-4, eps: 1.0e-8}\n"))
    assert s.spec.optimizer.lr == 3e-4 and s.spec.optimizer.eps == 1e-8


def test_a_duplicate_key_is_refused_naming_key_and_lines(tmp_path):
    msg = error_of(tmp_path, GOOD + "batch: [4]\n")
    assert "duplicate key 'batch'" in msg and "line 8" in msg and "first at line 5" in msg
    msg = error_of(tmp_path, "device: cpu\ngrids:\n  - {name: a, models: [tiny-llama], batch: [1], batch: [2], "
                             "seq: [8], methods: [sgd]}\n")
    assert "duplicate key 'batch'" in msg and "line 3" in msg


@pytest.mark.parametrize("name", ["../../tmp/bad/escape", "a/b", "..", "x..y", "has space", "."])
def test_suite_name_must_be_a_plain_file_name(tmp_path, name):
    msg = error_of(tmp_path, GOOD + f"name: {name!r}\n")
    assert "name: expected a plain file name" in msg and repr(name) in msg


def test_a_plain_suite_name_and_the_cpu_thread_setting(tmp_path):
    s = load_suite(write(tmp_path, GOOD + "name: smoke-2.cpu_x\ncpu_threads: 2\n"))
    assert s.name == "smoke-2.cpu_x" and s.spec.cpu_threads == 2
    assert load_suite(write(tmp_path, GOOD, "t.yaml")).spec.cpu_threads == 1, "a CPU cell runs one thread by default"
    assert "cpu_threads" in error_of(tmp_path, GOOD + "cpu_threads: 0\n")
