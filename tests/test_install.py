"""The project installs (``pip install -e .``) and its packages import from any directory.

Offline and quick: the source is copied to a temporary directory (the build writes egg-info
there, not into the repository), installed with ``--no-deps --no-build-isolation --no-index``
into a fresh virtual environment that sees this interpreter's packages (mlx, setuptools, ...)
through a ``.pth`` file, and then used from another directory.
"""

from __future__ import annotations

import shutil
import tomllib
import subprocess
import sys
import sysconfig
import venv
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES: tuple[str, ...] = tuple(
    tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
)
_NOT_SOURCE = shutil.ignore_patterns(
    ".git", ".venv*", "venv", "runs", "outputs", "build", "*.egg-info", "__pycache__", ".*_cache"
)


def _run(cmd: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, f"{cmd} failed:\n{result.stdout}\n{result.stderr}"
    return result


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    src = tmp_path_factory.mktemp("install") / "ppo-mlx"
    shutil.copytree(ROOT, src, ignore=_NOT_SOURCE)
    return src


@pytest.mark.slow
def test_editable_install_imports_from_another_directory(source: Path, tmp_path: Path) -> None:
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=False)
    python = env_dir / "bin" / "python"
    env_site = _run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], tmp_path
    ).stdout.strip()
    ours = dict.fromkeys([sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]])
    (Path(env_site) / "parent_env.pth").write_text("\n".join(ours) + "\n")

    install = [str(python), "-m", "pip", "install", "--no-deps", "--no-build-isolation"]
    _run(install + ["--no-index", "-e", str(source)], tmp_path)

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    snippet = (
        "import importlib, pathlib, sys\n"
        f"names = {list(PACKAGES)!r} + ['main']\n"
        "mods = [importlib.import_module(n) for n in names]\n"
        "print('\\n'.join(str(pathlib.Path(m.__file__).resolve()) for m in mods))\n"
        "from examples.task_common import DATA_DIR\n"
        "print(sorted(p.name for p in DATA_DIR.glob('*.jsonl')))\n"
        "from config.ppo_config import PPOConfig\n"
        "print(PPOConfig(model_name='runs/demo/sft/model').kl_coef)\n"
        "import importlib.util\n"
        "print(importlib.util.find_spec('tests'), importlib.util.find_spec('benchmarks'))\n"
    )
    out = _run([str(python), "-c", snippet], elsewhere).stdout.splitlines()
    files = [Path(line) for line in out[: len(PACKAGES) + 1]]
    assert all(f.is_relative_to(source.resolve()) for f in files), files
    assert out[len(PACKAGES) + 1] == "['code_tasks.jsonl', 'dialogue.jsonl', 'summarization.jsonl']"
    assert out[-1] == "None None"  # tests/ and benchmarks/ are not installed

    # The console script runs the command line from any directory.
    help_text = _run([str(env_dir / "bin" / "ppo-mlx"), "--help"], elsewhere).stdout
    assert "usage: ppo-mlx" in help_text and "demo" in help_text and "export" in help_text

    # A reward file of the user's in the working directory loads by module path, even named
    # like one of this package's folders (rewards, config).
    (elsewhere / "config.py").write_text("def brevity(completions, **kwargs):\n    return []\n")
    (elsewhere / "prompts.txt").write_text("Review of the lamp:\n")
    train = [str(env_dir / "bin" / "ppo-mlx"), "train", "--prompts", "prompts.txt"]
    train += ["--reward-fn", "config:brevity", "--set", "model_name=no-such-model-dir/x/y"]
    result = subprocess.run(train, cwd=elsewhere, capture_output=True, text=True, timeout=300)
    assert f"reward function brevity from {elsewhere.resolve() / 'config.py'}" in result.stderr


@pytest.mark.slow
def test_wheel_holds_the_packages_and_example_data(source: Path, tmp_path: Path) -> None:
    wheel_dir = tmp_path / "wheels"
    cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation"]
    _run(cmd + ["--no-index", "-w", str(wheel_dir), str(source)], tmp_path)
    (wheel,) = wheel_dir.glob("ppo_mlx-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    top = {name.split("/")[0] for name in names if not name.startswith("ppo_mlx-")}
    assert top == set(PACKAGES) | {"main.py"}
    for data in ("code_tasks", "dialogue", "summarization"):
        assert f"examples/data/{data}.jsonl" in names
    assert "sandbox/launcher.py" in names and "sandbox/runner.py" in names  # run as scripts
    metadata = next(n for n in names if n.endswith(".dist-info/METADATA"))
    requires = [
        line
        for line in zipfile.ZipFile(wheel).read(metadata).decode().splitlines()
        if line.startswith("Requires-Dist:")
    ]
    assert any(line.startswith("Requires-Dist: mlx-lm") for line in requires), requires
    entry_points = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
    assert "ppo-mlx = main:main" in zipfile.ZipFile(wheel).read(entry_points).decode()


def test_every_package_folder_is_declared() -> None:
    """A new top-level package must be added to pyproject.toml, or `pip install` leaves it out."""
    folders = {
        p.name
        for p in ROOT.iterdir()
        if (p / "__init__.py").is_file() and not p.name.startswith(".")
    }
    assert folders - {"tests", "benchmarks"} == set(PACKAGES)


def test_ci_runs_the_readmes_test_line_in_its_own_virtual_environment() -> None:
    readme = (ROOT / "README.md").read_text()
    quick = readme.split("## Quick start", 1)[1].split("```bash\n", 1)[1].split("```", 1)[0]
    demo, tests = quick.strip().splitlines()
    assert tests in (ROOT / ".ci" / "run").read_text().splitlines()
    venvs = [line.split("python3 -m venv ", 1)[1].split()[0] for line in (demo, tests)]
    assert venvs[0] != venvs[1], venvs  # the editable install and the dev tools apart
    ignored = (ROOT / ".gitignore").read_text().splitlines()
    pyproject = (ROOT / "pyproject.toml").read_text()
    for venv_dir in venvs:
        assert f"{venv_dir}/" in ignored
        assert venv_dir.replace(".", "\\.") in pyproject.split("[tool.black]")[1]  # black, mypy


def test_the_readmes_reward_moves_on_the_demo_model() -> None:
    from fixtures.demo_data import sft_records

    readme = (ROOT / "README.md").read_text()
    snippet = readme.split("```python\n", 1)[1].split("```", 1)[0]
    source = snippet[snippet.index("def reward(") :].split("\n\n", 1)[0]
    namespace: dict[str, object] = {}
    exec(source, namespace)
    reward = namespace["reward"]
    assert callable(reward)
    completions = [r["completion"] for r in sft_records(32)]  # what the demo's policy writes
    scores = reward(completions=completions, prompts=["p"] * len(completions))
    assert len(set(scores)) > 3  # varies over the demo's reviews: something to learn from
