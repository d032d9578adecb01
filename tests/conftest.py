"""Shared test set-up: MLX's fast BLAS (base_setup.setup_blas) before any test imports mlx.

The suite runs on the ``cmeel-openblas`` wheel's OpenBLAS (``PPO_MLX_BLAS=cmeel``, unless the
environment names another): its kernels are built for one CPU family, so every x86-64 machine with
AVX2 sums a matmul in the same order, and the golden runs (tests/golden) compare across machines.
scipy-openblas32, the default outside the tests, picks the kernels of each CPU;
tests/test_scipy_blas.py checks it in fresh processes.
"""

import os

os.environ.setdefault("PPO_MLX_BLAS", "cmeel")
# Eager training gradients: a compiled one builds its kernels with the system compiler the first
# time each model's graph is seen (minutes on a fresh CI machine); the tests that are about it
# (tests/test_compiled_gradient.py, the real checkpoint's GRPO step) turn it on themselves.
os.environ.setdefault("PPO_MLX_COMPILED_GRADIENT", "0")

from base_setup import setup_blas  # noqa: E402

setup_blas()  # pytest imports this file before the test modules, so before every mlx import

import compileall  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import pytest

ROOT = Path(__file__).resolve().parents[1]
#: Top-level folders of the checkout that hold no project source: virtual environments, build and
#: run outputs (hidden folders are skipped too).
NOT_SOURCE = {"venv", "build", "runs", "outputs", "exports"}


def pytest_configure(config: pytest.Config) -> None:
    """Compile the project's modules to bytecode once, before the tests start (in the main process;
    pytest-xdist's workers start after it).

    The suite starts about 120 Python processes (the command line, examples, ranks, the kill
    loop's runs), and most of them import the trainer. Where ``PYTHONDONTWRITEBYTECODE`` is set,
    as in some containers, no process leaves bytecode behind, so every one of them compiled the
    project's ~270 modules again: 0.4 s of each start, about 14% of the kill loop's time. This
    writes the usual ``__pycache__`` folders (ignored by git) that any run without the variable
    writes; a stale file is never used (Python checks each source's time stamp and size)."""
    if hasattr(config, "workerinput") or not sys.flags.dont_write_bytecode:
        return  # a worker; or each process writes the bytecode it compiles
    for entry in sorted(ROOT.iterdir()):
        if entry.name.startswith(".") or entry.name in NOT_SOURCE:
            continue
        if entry.is_dir():
            compileall.compile_dir(entry, quiet=1)
        elif entry.suffix == ".py":
            compileall.compile_file(entry, quiet=1)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The embedded tiny qwen3 checkpoint (size "test", seed 0), built once per test session."""
    from fixtures.tiny_model import build_tiny_checkpoint

    return build_tiny_checkpoint(tmp_path_factory.mktemp("tiny_model"), size="test", seed=0)


@pytest.fixture(autouse=True)
def _plot_only_where_the_test_looks(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every run that ends draws ``training_curves.png``: about 0.6 s of matplotlib, 230 times
    in the suite, a tenth of its time. In-process runs here check what the plot would draw
    (``plot_series``: the panels, every value a number) without rendering it; the tests that
    look at the picture say ``@pytest.mark.plots`` and get the real one, as do the runs of the
    command line in subprocesses."""
    if request.node.get_closest_marker("plots") is not None:
        return
    from training import metrics_logger

    def check_only(records: Any, out_path: str | Path) -> Path:
        metrics_logger.plot_series(records)
        return Path(out_path)

    monkeypatch.setattr(metrics_logger, "plot_metrics", check_only)
