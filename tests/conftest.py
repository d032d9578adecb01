"""Shared test set-up: MLX's fast BLAS (base_setup.setup_blas) before any test imports mlx."""

from base_setup import setup_blas

setup_blas()  # pytest imports this file before the test modules, so before every mlx import

from pathlib import Path  # noqa: E402

import pytest


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The embedded tiny qwen3 checkpoint (size "test", seed 0), built once per test session."""
    from fixtures.tiny_model import build_tiny_checkpoint

    return build_tiny_checkpoint(tmp_path_factory.mktemp("tiny_model"), size="test", seed=0)
