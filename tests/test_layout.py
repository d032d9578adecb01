"""The layout of docs/architecture.md: one folder per stage of the data flow, and a folder
imports only from the folders above it (so each stage can be read and tested with only what
comes before it)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# The data flow's order (docs/architecture.md's table).
ORDER = [
    "base_setup",
    "models",
    "fixtures",
    "token_attribution",
    "reward_kl",
    "advantage",
    "algorithms",
    "config",
    "experience_buffer",
    "training",
    "finetune",
    "sandbox",
    "rewards",
    "agents",
    "ppo_trainer",
    "examples",
]


def imported_packages(folder: str, root: Path = ROOT) -> dict[str, set[str]]:
    """``{file: the project's top-level packages it imports}`` over every ``.py`` in ``folder``,
    imports inside functions included."""
    found: dict[str, set[str]] = {}
    for path in sorted((root / folder).rglob("*.py")):
        names: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                names.update(alias.name.split(".")[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module.split(".")[0])
        found[str(path.relative_to(root))] = (names & set(ORDER)) - {folder}
    return found


def test_every_package_of_pyproject_is_in_the_order() -> None:
    import tomllib

    packages = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert sorted(packages["packages"]) == sorted(ORDER)


def test_a_folder_imports_only_from_the_folders_above_it() -> None:
    upward = [
        f"{path} imports {name}"
        for i, folder in enumerate(ORDER)
        for path, names in imported_packages(folder).items()
        for name in sorted(names)
        if ORDER.index(name) > i
    ]
    assert not upward, "imports against the data flow (docs/architecture.md):\n" + "\n".join(upward)


def test_the_check_sees_an_import_inside_a_function(tmp_path: Path) -> None:
    assert any("reward_kl" in names for names in imported_packages("advantage").values())
    (tmp_path / "advantage").mkdir()
    (tmp_path / "advantage" / "gae.py").write_text(
        "import numpy as np\nfrom reward_kl import kl\n\n\n"
        "def f():\n    from ppo_trainer.ppo_trainer import PPOTrainer\n"
    )
    assert imported_packages("advantage", tmp_path) == {
        "advantage/gae.py": {"reward_kl", "ppo_trainer"}
    }


def test_the_readme_stays_a_page_and_a_half() -> None:
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) < 170, f"README.md has {len(lines)} lines: move detail to docs/"


def module_imports(root: Path = ROOT) -> dict[str, set[str]]:
    """``{module: the project's modules it imports}`` over every ``.py`` of the packages of
    :data:`ORDER`, every import counted: inside functions and ``if TYPE_CHECKING:`` blocks too
    (a type checker follows them). ``from package import name`` counts ``package.name`` when that
    is a module, else the package."""
    files = {
        ".".join(path.relative_to(root).with_suffix("").parts).removesuffix(".__init__"): path
        for folder in ORDER
        for path in sorted((root / folder).rglob("*.py"))
    }
    graph: dict[str, set[str]] = {}
    for module, path in files.items():
        found: set[str] = set()
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                found.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: from the package, up level - 1
                    parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(parts + ([base] if base else []))
                for alias in node.names:
                    name = f"{base}.{alias.name}"
                    found.add(name if name in files else base)
        graph[module] = {name for name in found if name in files and name != module}
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(cycles)


def test_the_cycle_check_finds_a_cycle_through_a_type_checking_import(tmp_path: Path) -> None:
    (tmp_path / "ppo_trainer").mkdir()
    (tmp_path / "ppo_trainer" / "__init__.py").write_text("")
    (tmp_path / "ppo_trainer" / "a.py").write_text("from ppo_trainer.b import f\n")
    (tmp_path / "ppo_trainer" / "b.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ppo_trainer import a\n"
    )
    (tmp_path / "ppo_trainer" / "c.py").write_text("from . import b\n")
    graph = module_imports(tmp_path)
    assert graph["ppo_trainer.c"] == {"ppo_trainer.b"}
    assert import_cycles(graph) == [["ppo_trainer.a", "ppo_trainer.b"]]


def test_no_import_cycle_between_modules() -> None:
    cycles = import_cycles(module_imports())
    assert (
        not cycles
    ), "import cycles between modules (a TYPE_CHECKING import counts):\n" + "\n".join(
        " <-> ".join(c) for c in cycles
    )


def long_functions(limit: int, root: Path = ROOT) -> list[str]:
    """``"path:function (n lines)"`` for every function of the library (the folders of
    :data:`ORDER` and ``main.py``) longer than ``limit`` lines, its docstring included."""
    paths = [p for folder in ORDER for p in sorted((root / folder).rglob("*.py"))]
    found = []
    for path in [*paths, root / "main.py"]:
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                assert node.end_lineno is not None
                lines = node.end_lineno - node.lineno + 1
                if lines > limit:
                    found.append(f"{path.relative_to(root)}:{node.name} ({lines} lines)")
    return found


def test_no_library_function_is_over_a_hundred_lines(tmp_path: Path) -> None:
    """A function that grows past a screenful and a half is split by what it does (the
    trainer's step reads as phases, each a function of its own)."""
    long_functions_found = long_functions(100)
    assert not long_functions_found, "\n".join(long_functions_found)
    (tmp_path / "base_setup").mkdir()  # the check finds one
    body = "\n".join(f"    x{i} = {i}" for i in range(100))
    (tmp_path / "base_setup" / "long.py").write_text(f"def long() -> None:\n{body}\n")
    (tmp_path / "main.py").write_text("")
    assert long_functions(100, tmp_path) == ["base_setup/long.py:long (101 lines)"]


def test_the_trainer_is_a_facade() -> None:
    """``PPOTrainer`` composes collaborators built once (rollout parts, updater, evaluator,
    checkpoints) rather than wiring every feature through itself: the class stays at most 250
    lines and its ``step()``, which reads as the phases, at most 50."""
    tree = ast.parse((ROOT / "ppo_trainer" / "ppo_trainer.py").read_text(encoding="utf-8"))
    (trainer,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "PPOTrainer"]
    assert trainer.end_lineno is not None
    assert trainer.end_lineno - trainer.lineno + 1 <= 250
    (step,) = [n for n in trainer.body if isinstance(n, ast.FunctionDef) and n.name == "step"]
    assert step.end_lineno is not None
    assert step.end_lineno - step.lineno + 1 <= 50
