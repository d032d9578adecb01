"""Shared test set-up. Importing base_setup first gives MLX its fast BLAS in the test process."""

import base_setup  # noqa: F401  (must precede every mlx import)

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The embedded tiny qwen3 checkpoint (size "test", seed 0), built once per test session."""
    from models.tiny_model import build_tiny_checkpoint

    return build_tiny_checkpoint(tmp_path_factory.mktemp("tiny_model"), size="test", seed=0)
