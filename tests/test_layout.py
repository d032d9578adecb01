"""The layout of docs/architecture.md: one folder per stage of the data flow, and a folder
imports only from the folders above it (so each stage can be read and tested with only what
comes before it)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# The data flow's order (docs/architecture.md's table).
ORDER = [
    "config",
    "base_setup",
    "models",
    "fixtures",
    "token_attribution",
    "reward_kl",
    "advantage",
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
