"""YAML suite -> validated list of cells.

A suite is one or more grids of models x batch x seq x methods (x world sizes x data-parallel
bucket sizes, for the distributed arms) sharing one set of run
settings (device, dtype, warm-up, timed steps, repeats, parity gate, timeout, optimizer
hyper-parameters). A file with top-level ``models/batch/seq/methods`` and no ``grids`` is one
grid named ``main``. Grids let a suite name its headline cell so ``--only headline`` runs it
alone. A cell that two grids share runs once (the first grid's name is its label).

Types are strict: a number field takes a YAML number and nothing else (``batch: [true]`` or
``seq: ["16"]`` is an error naming the field, not 1 or 16), a duplicate key is an error naming it
and its lines, and ``name`` is a safe file name (it becomes the default results folder and part of
the run id). Errors are one line: ``<file>: <field>: <what was expected>``.
"""
from __future__ import annotations

import fnmatch
import hashlib
import json
import re
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (BaseModel, ConfigDict, Field, StrictFloat, ValidationError, field_validator,
                      model_validator)

from forge_bench import methods as methods_mod
from forge_bench import models as models_mod

DEFAULT_SUITE = "smoke.yaml"   # shipped inside the package: what `forge-bench sweep` runs without a suite
DEFAULT_WARMUP = {"cuda": 30, "cpu": 3}


class SuiteError(ValueError):
    """A suite file that cannot be used; the message is one line naming file and field."""


# A suite name becomes the default results folder and part of every run id: a plain file name.
SAFE_NAME = re.compile(r"[A-Za-z0-9_.-]+")


class _Strict(BaseModel):
    # strict: YAML's `true` or "16" where a number belongs is an error, never 1 or 16
    model_config = ConfigDict(extra="forbid", strict=True)


class OptimizerSettings(_Strict):
    lr: float = Field(1e-4, gt=0)
    # YAML has no tuple: the list is accepted as the pair, its items stay strict numbers
    betas: Annotated[tuple[StrictFloat, StrictFloat], Field(strict=False)] = (0.9, 0.95)
    eps: float = Field(1e-8, gt=0)
    weight_decay: float = Field(0.1, ge=0)
    momentum: float = Field(0.9, ge=0, lt=1)

    @field_validator("betas")
    @classmethod
    def _betas_in_range(cls, betas: tuple[float, float]) -> tuple[float, float]:
        if not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"expected two numbers in [0, 1), got {list(betas)}")
        return betas


class ParitySettings(_Strict):
    enabled: bool = True
    steps: int = Field(20, ge=1)
    tolerance: float = Field(0.05, gt=0, description="bound on the worst weight matrix's rms-rel vs the fp32 reference")
    max_layers: int = Field(2, ge=1, description="big models are gated on a twin with this many layers")


BRIEF_ITEMS = 8
"""How many values of a list an error names before "... (N more)": a 1000-entry grid's error stays one short line."""


def brief(values: list[Any], limit: int = BRIEF_ITEMS) -> str:
    """``[1, 2, 3, ... (997 more)]``: a list for a one-line error, at most ``limit`` items shown."""
    shown = ", ".join(map(repr, values[:limit]))
    return f"[{shown}{f', ... ({len(values) - limit:,} more)' if len(values) > limit else ''}]"


def _repeated(values: list[Any]) -> list[Any]:
    """The values given more than once, each once, in first-seen order."""
    seen: set[Any] = set()
    return list(dict.fromkeys(v for v in values if v in seen or seen.add(v)))


def _names_check(values: list[str], known: dict[str, Any], what: str) -> list[str]:
    unknown = [v for v in values if v not in known]
    if unknown:
        raise ValueError(f"unknown {what} {brief(unknown)[1:-1]}; known: {', '.join(sorted(known))}")
    if len(set(values)) != len(values):
        raise ValueError(f"{what} names repeat: {brief(_repeated(values))}")
    return values


class Grid(_Strict):
    name: str = Field("main", pattern=r"^[A-Za-z0-9_.-]+$")
    models: list[str] = Field(min_length=1)
    batch: list[int] = Field(min_length=1)
    seq: list[int] = Field(min_length=1)
    methods: list[str] = Field(min_length=1)
    timeout_s: float | None = Field(None, gt=0, description="per-cell limit for this grid (default: the suite's)")
    repeats: int | None = Field(None, ge=1, description="timed repeats of each cell of this grid (default: the "
                                "suite's): more of them for a step bound by the host, whose speed drifts")
    cuda_graph: bool = Field(False, description="time each step as a replay of the whole step captured in one "
                                                "CUDA graph (no per-kernel launch cost); arms that cannot be "
                                                "captured get an 'unavailable' row")
    world_size: list[int] = Field([1], min_length=1, description="ranks per cell: a distributed arm (a method with a "
                                  "strategy) runs as one torchrun process tree of that many ranks; a one-process "
                                  "arm takes only 1 (else its cell's row is 'unavailable')")
    bucket_cap_mb: list[float] | None = Field(None, min_length=1,
                                              description="gradient bucket sizes, MB, for the data-parallel arms "
                                                          "(strategy dp); other arms ignore it (default: 25, DDP's)")
    activations: Literal["hf", "lean"] = Field(
        "hf", description="hf: the transformers model as it is; lean: forge_core.lean_activations (the norms "
                          "and SwiGLU keep less for backward) applied to every arm of the grid, baselines included")
    dtype: Literal["bfloat16", "float32", "float16"] | None = Field(
        None, description="this grid's weight dtype (default: the suite's): fp32 weights keep every unfused "
                          "optimizer's states in fp32, as the paper's App. I runs them")
    activation_checkpointing: bool = Field(
        False, description="transformers' gradient checkpointing (non-reentrant) on every arm of the grid: each "
                           "decoder layer keeps its input and recomputes the rest in backward")

    @field_validator("models")
    @classmethod
    def _known_models(cls, v: list[str]) -> list[str]:
        return _names_check(v, models_mod.MODEL_ZOO, "model")

    @field_validator("methods")
    @classmethod
    def _known_methods(cls, v: list[str]) -> list[str]:
        return _names_check(v, methods_mod.METHODS, "method")

    @field_validator("bucket_cap_mb")
    @classmethod
    def _positive_buckets(cls, v: list[float] | None) -> list[float] | None:
        if v is not None:
            bad = [x for x in v if not x > 0]
            if bad:
                raise ValueError(f"expected sizes > 0 MB, got {brief(bad)}")
            if len(set(v)) != len(v):
                raise ValueError(f"bucket sizes repeat: {brief(_repeated(v))}")
        return v

    @field_validator("batch", "seq", "world_size")
    @classmethod
    def _positive(cls, v: list[int]) -> list[int]:
        bad = [x for x in v if x < 1]
        if bad:
            raise ValueError(f"expected positive integers, got {brief(bad)}")
        return v

    @model_validator(mode="after")
    def _lean_needs_llama_blocks(self) -> "Grid":
        if self.activations == "lean":
            unsupported = [m for m in self.models if not models_mod.has_lean_blocks(m)]
            if unsupported:
                raise ValueError(f"activations: lean needs Llama-style blocks (RMSNorm + SiLU-gated MLP); "
                                 f"{', '.join(map(repr, unsupported))} has none")
        return self

    @model_validator(mode="after")
    def _one_activation_saving(self) -> "Grid":
        if self.activation_checkpointing and self.activations == "lean":
            raise ValueError("activation_checkpointing and activations: lean are two ways to keep fewer "
                             "activations; pick one")
        return self

    @model_validator(mode="after")
    def _seq_fits_models(self) -> "Grid":
        for model in self.models:
            limit = models_mod.max_seq_len(model)
            too_long = [s for s in self.seq if s > limit]
            if too_long:
                raise ValueError(f"seq {brief(too_long)} too long for model {model!r} (at most {limit} tokens)")
        return self


def check_safe_name(name: str) -> str:
    """``name`` when it is a safe file name (letters, digits, ``-``, ``_``, ``.``; not ``.``-only
    or holding ``..``), else ValueError saying what is allowed."""
    if not SAFE_NAME.fullmatch(name) or ".." in name or set(name) == {"."}:
        raise ValueError(f"expected a plain file name (letters, digits, '-', '_', '.'; no '/' or '..'), got {name!r}")
    return name


class SuiteSpec(_Strict):
    name: str | None = Field(None, description="default results folder results/<name> and part of the run id; "
                                              "default: the file's stem")
    description: str = ""
    device: str = Field("cuda", pattern=r"^(cpu|cuda(:\d+)?)$")
    dtype: Literal["bfloat16", "float32", "float16"] = "bfloat16"
    warmup_steps: int | None = Field(None, ge=0, description="default: 30 on cuda, 3 on cpu")
    timed_steps: int = Field(20, ge=1)
    repeats: int = Field(3, ge=1)
    timeout_s: float = Field(900.0, gt=0, description="per-cell wall-clock limit, process start to row")
    cpu_threads: int = Field(1, ge=1, description="torch threads of each cell process on a CPU device "
                                                 "(torch.set_num_threads; `sweep --threads` overrides it)")
    seed: int = 0
    optimizer: OptimizerSettings = OptimizerSettings()
    parity: ParitySettings = ParitySettings()
    grids: list[Grid] | None = None
    # the one-grid shorthand
    models: list[str] | None = None
    batch: list[int] | None = None
    seq: list[int] | None = None
    methods: list[str] | None = None

    @field_validator("name")
    @classmethod
    def _safe_name(cls, name: str | None) -> str | None:
        return None if name is None else check_safe_name(name)

    @model_validator(mode="before")
    @classmethod
    def _one_grid_shorthand(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        short = {k: data[k] for k in ("models", "batch", "seq", "methods") if k in data}
        if short and "grids" in data:
            raise ValueError("give either 'grids' or top-level models/batch/seq/methods, not both")
        if not short and "grids" not in data:
            raise ValueError("expected 'grids' (a list) or top-level models, batch, seq and methods")
        if short:
            data = {k: v for k, v in data.items() if k not in short}
            data["grids"] = [{"name": "main", **short}]
        return data

    @model_validator(mode="after")
    def _checks(self) -> "SuiteSpec":
        if not self.grids:
            raise ValueError("grids: expected at least one grid")
        names = [g.name for g in self.grids]
        if len(set(names)) != len(names):
            raise ValueError(f"grids: names repeat: {brief(_repeated(names))}")
        if self.warmup_steps is None:
            self.warmup_steps = DEFAULT_WARMUP["cpu" if self.device == "cpu" else "cuda"]
        graphed = [g.name for g in self.grids if g.cuda_graph]
        if graphed and self.device == "cpu":
            raise ValueError(f"grids {graphed}: cuda_graph needs device cuda (this suite runs on cpu)")
        return self

    @property
    def device_type(self) -> str:
        return "cpu" if self.device == "cpu" else "cuda"

    def train_config(self, cuda_graph: bool = False) -> methods_mod.TrainConfig:
        o = self.optimizer
        return methods_mod.TrainConfig(lr=o.lr, betas=tuple(o.betas), eps=o.eps, weight_decay=o.weight_decay,
                                       momentum=o.momentum, device=self.device, capturable=cuda_graph)


@dataclass(frozen=True)
class Cell:
    """One measurement: a model at one shape with one method, under one suite."""
    cell_id: str
    grid: str
    model: str
    batch: int
    seq: int
    method: str
    dtype: str
    device: str
    timeout_s: float
    cuda_graph: bool = False
    activations: str = "hf"      # "lean": forge_core.lean_activations applied before the arm is built
    activation_checkpointing: bool = False   # transformers' gradient checkpointing before the arm is built
    world_size: int = 1          # ranks (a distributed arm's torchrun process tree)
    bucket_cap_mb: float | None = None   # a data-parallel arm's gradient bucket (None: 25 MB, DDP's default)
    repeats: int | None = None   # timed repeats (None: the suite's; ``timed_repeats``)

    def timed_repeats(self, spec: "SuiteSpec") -> int:
        """The cell's timed repeats: its grid's where it sets them, else the suite's."""
        return self.repeats if self.repeats is not None else spec.repeats

    @property
    def label(self) -> str:
        return (f"{self.grid}/{self.model}/b{self.batch}/s{self.seq}/{self.method}"
                + distributed_marks(self.world_size, self.bucket_cap_mb, self.distributed, "/"))

    @property
    def distributed(self) -> bool:
        """Whether the cell runs as a torchrun process tree (its method has a strategy)."""
        method = methods_mod.METHODS.get(self.method)
        return method is not None and method.strategy is not None


@dataclass(frozen=True)
class Suite:
    path: Path
    name: str
    sha256: str          # first 16 hex of the file's bytes
    spec: SuiteSpec
    cells: tuple[Cell, ...]

    def cell(self, cell_id: str) -> Cell:
        for c in self.cells:
            if c.cell_id == cell_id:
                return c
        raise SuiteError(f"{self.path}: no cell with id {cell_id!r}")

    def select(self, only: str | None) -> list[Cell]:
        return select_cells(self.cells, only)


def _safe(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", text)


def distributed_marks(world_size: int, bucket_cap_mb: float | None, distributed: bool, separator: str) -> str:
    """``w<N>`` (for a distributed arm, or N != 1) and ``bucket<MB>`` (when set), each after ``separator``:
    "" for a one-process cell, so its label and id read as they always did."""
    marks = ([f"w{world_size}"] if distributed or world_size != 1 else []) + \
        ([f"bucket{bucket_cap_mb:g}"] if bucket_cap_mb is not None else [])
    return "".join(separator + mark for mark in marks)


def make_cell_id(suite_hash: str, model: str, batch: int, seq: int, method: str, dtype: str, device: str,
                 cuda_graph: bool = False, activations: str = "hf", activation_checkpointing: bool = False,
                 world_size: int = 1, bucket_cap_mb: float | None = None) -> str:
    """Stable, readable, file-name safe: the shape in clear plus a hash of everything that defines it
    (a graph-timed or lean cell is marked; an eager hf cell's fields carry no mark, so its id stays the
    same whatever grid options exist, and a run of it resumes)."""
    fields: list = [suite_hash, model, batch, seq, method, dtype, device]
    if cuda_graph:
        fields.append("cuda_graph")
    if activations != "hf":
        fields.append(f"activations={activations}")
    if activation_checkpointing:
        fields.append("activation_checkpointing")
    if world_size != 1:
        fields.append(f"world_size={world_size}")
    if bucket_cap_mb is not None:
        fields.append(f"bucket_cap_mb={bucket_cap_mb:g}")
    digest = hashlib.sha256(json.dumps(fields).encode()).hexdigest()[:10]
    marks = ("_graph" if cuda_graph else "") + (f"_{activations}" if activations != "hf" else "") \
        + ("_ckpt" if activation_checkpointing else "")
    registered = methods_mod.METHODS.get(method)
    marks += _safe(distributed_marks(world_size, bucket_cap_mb, registered is not None and registered.strategy is not None,
                                     "_"))
    return f"{_safe(model)}_b{batch}_s{seq}_{_safe(method)}{marks}_{digest}"


def expand(spec: SuiteSpec, suite_hash: str) -> tuple[Cell, ...]:
    """The grid product, in order grid > model > batch > seq > method > world size > bucket (arms of one
    shape adjacent). A bucket size multiplies only the data-parallel arms (strategy dp)."""
    cells: dict[str, Cell] = {}
    for grid in spec.grids or []:
        for model in grid.models:
            for batch in grid.batch:
                for seq in grid.seq:
                    for method in grid.methods:
                        dtype = grid.dtype or spec.dtype
                        registered = methods_mod.METHODS.get(method)
                        buckets: list[float | None] = [None]
                        if grid.bucket_cap_mb and registered is not None and registered.strategy == "dp":
                            buckets = list(grid.bucket_cap_mb)
                        for world_size in grid.world_size:
                            for bucket in buckets:
                                cid = make_cell_id(suite_hash, model, batch, seq, method, dtype, spec.device,
                                                   grid.cuda_graph, grid.activations, grid.activation_checkpointing,
                                                   world_size, bucket)
                                cells.setdefault(cid, Cell(
                                    cid, grid.name, model, batch, seq, method, dtype, spec.device,
                                    grid.timeout_s or spec.timeout_s, grid.cuda_graph, grid.activations,
                                    activation_checkpointing=grid.activation_checkpointing,
                                    world_size=world_size, bucket_cap_mb=bucket, repeats=grid.repeats))
    return tuple(cells.values())


def select_cells(cells: tuple[Cell, ...] | list[Cell], only: str | None) -> list[Cell]:
    """Cells whose label matches any comma-separated pattern (glob; a plain word is a substring)."""
    if not only:
        return list(cells)
    patterns = [p.strip() for p in only.split(",") if p.strip()]
    globs = [p if any(ch in p for ch in "*?[") else f"*{p}*" for p in patterns]
    return [c for c in cells if any(fnmatch.fnmatchcase(c.label, g) for g in globs)]


def default_suite_path() -> Path:
    return Path(str(resources.files("forge_bench") / "suites" / DEFAULT_SUITE))


def _format_validation_error(path: Path, err: ValidationError, shorthand: bool) -> str:
    errors = err.errors()
    parts = []
    for e in errors[:3]:
        loc = ".".join(f"[{x}]" if isinstance(x, int) else str(x) for x in e["loc"]).replace(".[", "[")
        if shorthand:   # the user wrote top-level models/batch/seq/methods, not grids[0]
            loc = loc.removeprefix("grids[0].")
        msg = str(e["msg"]).removeprefix("Value error, ")
        if e["type"] == "extra_forbidden":
            msg = "unknown field (a typo?)"
        elif e["type"] == "missing":
            msg = "required field is missing"
        got = e.get("input")
        shown = brief(got) if isinstance(got, list) else repr(got)
        shown = shown if len(shown) <= 40 else shown[:37] + "..."
        detail = f" (got {shown})" if e["type"] not in ("missing", "value_error") and not isinstance(got, dict) else ""
        parts.append(f"{loc or '<top level>'}: {msg}{detail}")
    more = f" (and {len(errors) - 3} more)" if len(errors) > 3 else ""
    return f"{path}: " + "; ".join(parts) + more


class SuiteLoader(yaml.SafeLoader):
    """PyYAML's safe loader that refuses a key given twice in one mapping (plain PyYAML keeps the
    last silently) and reads ``1e-3`` as a number, as YAML 1.2 does (YAML 1.1 makes it a string,
    which the strict number fields would refuse)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r} (first at line {seen[key]})", key_node.start_mark)
            seen[key] = line
        return super().construct_mapping(node, deep=deep)


SuiteLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"))


def load_suite(path: str | Path | None = None) -> Suite:
    """Parse and validate a suite file (None: the smoke suite shipped in the package)."""
    methods_mod.load_plugins()
    path = default_suite_path() if path is None else Path(path)
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise SuiteError(f"{path}: cannot read suite file: {exc.strerror or exc}") from None
    try:
        data = yaml.load(raw, Loader=SuiteLoader)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise SuiteError(f"{path}: not valid YAML{where}: {problem}") from None
    if not isinstance(data, dict):
        raise SuiteError(f"{path}: expected a mapping of suite fields at the top level, got {type(data).__name__}")
    try:
        spec = SuiteSpec.model_validate(data)
    except ValidationError as exc:
        raise SuiteError(_format_validation_error(path, exc, shorthand="grids" not in data)) from None
    sha = hashlib.sha256(raw).hexdigest()[:16]
    name = spec.name or _safe(path.stem)
    return Suite(path=path.resolve(), name=name, sha256=sha, spec=spec, cells=expand(spec, sha))
