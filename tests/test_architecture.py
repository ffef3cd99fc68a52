"""The shape of the two packages, read from their syntax trees (nothing is imported).

* No module imports a private name (``_x``) from another module of the packages, by ``from m import
  _x`` or as ``m._x`` of an imported module: what modules share has a public, documented name.
* No import cycle among a package's modules, counting imports inside functions too (a lazy import
  that only dodges a cycle is still the cycle).
* No module over ``MAX_LINES`` lines.
* The committed results (``git ls-files results``) take at most ``RESULTS_BUDGET`` bytes: a finished
  folder goes in packed (``forge-bench pack``), and a run a newer one of the same command replaced
  leaves in the commit that adds the newer.
* Every folder ``results/README.md`` lists holds files git keeps: a folder whose files ``.gitignore``
  drops would be cited by the docs and absent from every clone.
"""
from __future__ import annotations

import ast
import re
import subprocess
from collections import Counter
from fnmatch import fnmatch
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MAX_LINES = 700
PACKAGES = ["forge_core", "forge_bench"]
RESULTS_BUDGET = 5_000_000
KEPT_PATTERN_PREFIX = "!/results/*/**/"


def _modules(package: str, root: Path = ROOT) -> dict[str, Path]:
    """Dotted module name -> file, for every module of ``package`` (a package is its ``__init__``)."""
    modules = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join(parts)] = path
    return modules


def _is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _imports(module: str, path: Path, known: dict[str, Path]) -> tuple[set[str], list[str]]:
    """(the known modules ``module`` imports, anywhere in its body; its uses of another module's
    private names, as 'line: text')."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    tree = ast.parse(path.read_text(), filename=str(path))
    imported: set[str] = set()
    aliases: dict[str, str] = {}          # local name -> known module it is bound to
    private: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name in known:
                    imported.add(alias.name)
                    if alias.asname:
                        aliases[alias.asname] = alias.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            if source not in known:
                continue
            for alias in node.names:
                submodule = f"{source}.{alias.name}"
                if submodule in known:
                    imported.add(submodule)
                    aliases[alias.asname or alias.name] = submodule
                else:
                    imported.add(source)
                    if _is_private(alias.name):
                        private.append(f"{node.lineno}: from {source} import {alias.name}")
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases \
                and _is_private(node.attr):
            private.append(f"{node.lineno}: {aliases[node.value.id]}.{node.attr}")
    imported.discard(module)
    return imported, private


def _graph(package: str, root: Path = ROOT) -> tuple[dict[str, set[str]], dict[str, list[str]]]:
    """Per module: the package's modules it imports, and its uses of their private names."""
    known = _modules(package, root)
    edges, private = {}, {}
    for module, path in known.items():
        edges[module], private[module] = _imports(module, path, known)
    return edges, private


def _cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of ``edges`` as a path that ends where it starts, or None."""
    state: dict[str, int] = {}            # 1: on the current path, 2: done
    path: list[str] = []

    def visit(module: str) -> list[str] | None:
        state[module] = 1
        path.append(module)
        for target in sorted(edges.get(module, ())):
            if state.get(target) == 1:
                return path[path.index(target):] + [target]
            if target not in state:
                found = visit(target)
                if found:
                    return found
        path.pop()
        state[module] = 2
        return None

    for module in sorted(edges):
        if module not in state:
            found = visit(module)
            if found:
                return found
    return None


@pytest.mark.parametrize("package", PACKAGES)
def test_no_module_imports_a_private_name_of_another(package):
    _, private = _graph(package)
    offenders = {module: uses for module, uses in private.items() if uses}
    assert not offenders, f"private names used across modules (give them a public name): {offenders}"


@pytest.mark.parametrize("package", PACKAGES)
def test_no_import_cycle(package):
    edges, _ = _graph(package)
    cycle = _cycle(edges)
    assert cycle is None, f"import cycle: {' -> '.join(cycle)}"


@pytest.mark.parametrize("package", PACKAGES)
def test_no_module_is_over_the_line_limit(package):
    long = {module: n for module, path in _modules(package).items()
            if (n := len(path.read_text().splitlines())) > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines: {long}"


def test_the_checks_see_a_private_import_and_a_cycle(tmp_path):
    """The checker itself: a planted private import, private attribute use and cycle are found."""
    package = tmp_path / "planted"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("from .b import _hidden\n\n\ndef f():\n    from . import b\n    return b._other\n")
    (package / "b.py").write_text("def g():\n    from .a import f\n    return f\n")
    edges, private = _graph("planted", tmp_path)
    assert private["planted.a"] == ["1: from planted.b import _hidden", "6: planted.b._other"]
    assert _cycle(edges) == ["planted.a", "planted.b", "planted.a"]


def _committed_results(root: Path = ROOT) -> dict[Path, int]:
    """Bytes of each file under ``root/results`` that git keeps (``git ls-files``); where git cannot
    say (a copy of the tree without its repository), of each file there that .gitignore admits."""
    try:
        listed = subprocess.run(["git", "-C", str(root), "ls-files", "-z", "--", "results"], capture_output=True,
                                check=True, timeout=120).stdout.decode().split("\0")
        paths = [root / name for name in listed if name]
    except (OSError, subprocess.SubprocessError):
        kept = [line.removeprefix(KEPT_PATTERN_PREFIX) for line in (root / ".gitignore").read_text().splitlines()
                if line.startswith(KEPT_PATTERN_PREFIX) and not line.endswith("/")]
        paths = [path for path in (root / "results").rglob("*") if path.is_file()
                 and (path.parent == root / "results" or any(fnmatch(path.name, pattern) for pattern in kept))]
    return {path: path.stat().st_size for path in paths if path.is_file()}


def _over_budget(sizes: dict[Path, int], root: Path = ROOT) -> str | None:
    """None within ``RESULTS_BUDGET``; otherwise one line with the total and the largest folders."""
    total = sum(sizes.values())
    if total <= RESULTS_BUDGET:
        return None
    folders: Counter[str] = Counter()
    for path, size in sizes.items():
        parts = path.relative_to(root).parts
        folders["/".join(parts[:3]) if len(parts) > 3 else "/".join(parts[:-1]) or parts[0]] += size
    largest = ", ".join(f"{folder} {size / 1e6:.2f} MB" for folder, size in folders.most_common(5))
    return (f"results/ holds {total / 1e6:.2f} MB in git, over its {RESULTS_BUDGET / 1e6:.0f} MB: pack finished "
            f"folders (forge-bench pack) and remove runs newer ones replaced; largest: {largest}")


def test_committed_results_fit_their_budget():
    sizes = _committed_results()
    assert sizes, "no committed results found"
    problem = _over_budget(sizes)
    assert problem is None, problem


def test_the_budget_counts_what_git_keeps_and_names_the_largest_folders(tmp_path):
    """Outside a repository: the files .gitignore admits (rows, manifests), not a study's checkpoints."""
    (tmp_path / ".gitignore").write_text((ROOT / ".gitignore").read_text())
    big, small = tmp_path / "results" / "h200" / "table1_x", tmp_path / "results" / "h100" / "grid_y"
    for folder, size in ((big, 4_000_000), (small, 1_500_000)):
        folder.mkdir(parents=True)
        with (folder / "rows.parquet").open("wb") as fh:
            fh.truncate(size)
        (folder / "manifest.json").write_text("{}")
    (big / "checkpoints").mkdir()
    with (big / "checkpoints" / "forge_bf16_seed0.pt").open("wb") as fh:
        fh.truncate(50_000_000)
    sizes = _committed_results(tmp_path)
    assert sum(sizes.values()) == 5_500_004 and len(sizes) == 4
    problem = _over_budget(sizes, tmp_path)
    assert problem.startswith("results/ holds 5.50 MB in git, over its 5 MB") and \
        problem.endswith("largest: results/h200/table1_x 4.00 MB, results/h100/grid_y 1.50 MB"), problem
    (big / "rows.parquet").unlink()
    assert _over_budget(_committed_results(tmp_path), tmp_path) is None


LISTED_FOLDER = re.compile(r"^\| `((?:h100|h200|kernels)/[^`]+?)/?` \|", re.MULTILINE)
"""A folder's cell in ``results/README.md``'s table: its path under ``results/``, first in its row."""


def _listed_without_files(root: Path = ROOT) -> list[str]:
    """The folders ``root/results/README.md`` lists that hold no file git keeps (``_committed_results``)."""
    listed = LISTED_FOLDER.findall((root / "results" / "README.md").read_text())
    held = {parent for path in _committed_results(root) for parent in path.relative_to(root / "results").parents}
    return [folder for folder in listed if Path(folder) not in held]


def test_every_listed_results_folder_is_in_git():
    missing = _listed_without_files()
    assert not missing, f"results/README.md lists folders git does not keep (see .gitignore): {missing}"


def test_a_listed_folder_of_ignored_files_is_named(tmp_path):
    """Outside a repository: a listed folder holding only a file .gitignore drops is named; rows keep one."""
    (tmp_path / ".gitignore").write_text((ROOT / ".gitignore").read_text())
    kept, dropped = tmp_path / "results" / "h200" / "table1_x", tmp_path / "results" / "h200" / "notes_y"
    for folder in (kept, dropped):
        folder.mkdir(parents=True)
    (kept / "rows.parquet").write_bytes(b"PAR1")
    (dropped / "scratch.txt").write_text("a log")
    (tmp_path / "results" / "README.md").write_text(
        "| folder | GPU |\n|---|---|\n| `h200/table1_x/` | H200 |\n| `h200/notes_y/` | H200 |\n")
    assert _listed_without_files(tmp_path) == ["h200/notes_y"]
