"""The fast BLAS is active in the test process, and seeding is reproducible."""

import ctypes
import random
import subprocess
import sys
import time
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from base_setup import blas_info, seed_everything
from base_setup.backend import BlasInfo

ROOT = Path(__file__).resolve().parent.parent
LINUX_X86 = sys.platform.startswith("linux") and "x86_64" in (
    subprocess.run(["uname", "-m"], capture_output=True, text=True).stdout
)


def _loaded_libraries() -> str:
    return Path("/proc/self/maps").read_text()


@pytest.mark.skipif(not LINUX_X86, reason="OpenBLAS is loaded on Linux x86_64 only")
def test_openblas_is_loaded_and_bound() -> None:
    info = blas_info()
    assert info.name == "openblas", info.detail
    assert "libopenblas" in _loaded_libraries()
    # The symbol MLX calls resolves, in the global scope, to OpenBLAS's definition.
    handle = ctypes.CDLL(None)
    sgemm = ctypes.cast(handle.cblas_sgemm, ctypes.c_void_p).value
    openblas = ctypes.CDLL(info.detail.split(" from ")[1].split(",")[0])
    assert sgemm == ctypes.cast(openblas.cblas_sgemm, ctypes.c_void_p).value


_MATMUL_RATE = """
import os, sys, time
sys.path.insert(0, os.getcwd())
import base_setup, mlx.core as mx
a = mx.random.normal((1024, 1024)); mx.eval(a @ a)
best = float("inf")
for _ in range(3):
    start = time.perf_counter(); mx.eval(a @ a); best = min(best, time.perf_counter() - start)
print(2 * 1024**3 / best / 1e9)
"""


def _matmul_gflops(env_extra: dict[str, str]) -> float:
    import os

    out = subprocess.run(
        [sys.executable, "-c", _MATMUL_RATE],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, **env_extra},
    )
    return float(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not LINUX_X86, reason="OpenBLAS is loaded on Linux x86_64 only")
def test_matmul_runs_far_above_reference_blas_rate() -> None:
    # Same matmul, same machine load, two processes: with OpenBLAS and with the wheel's reference
    # BLAS (PPO_MLX_BLAS=reference). A ratio is robust to a busy machine where an absolute rate
    # is not; measured here the ratio is about 30.
    fast = _matmul_gflops({})
    slow = _matmul_gflops({"PPO_MLX_BLAS": "reference"})
    assert fast > 3 * slow, f"OpenBLAS {fast:.1f} vs reference {slow:.1f} GFLOP/s ({blas_info()})"


def test_import_order_is_enforced_in_a_fresh_process() -> None:
    """Importing mlx before base_setup is detected and reported, not silently slow."""
    code = "import mlx.core, base_setup; print(base_setup.blas_info().name)"
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == ("accelerate" if sys.platform == "darwin" else "reference")


def test_user_script_import_gets_fast_blas() -> None:
    """`import ppo_trainer` from a user's script is an entry point too."""
    code = "import ppo_trainer, base_setup; print(base_setup.blas_info().name)"
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
    )
    expected = "openblas" if LINUX_X86 else blas_info().name
    assert out.stdout.strip() == expected


def test_blas_info_is_a_dataclass() -> None:
    assert isinstance(blas_info(), BlasInfo)


def test_seed_everything_seeds_all_three_rngs() -> None:
    def draw() -> tuple[float, float, float]:
        return random.random(), float(np.random.rand()), float(np.asarray(mx.random.uniform()))

    seed_everything(123)
    first = draw()
    seed_everything(123)
    assert draw() == first
    seed_everything(124)
    assert draw() != first


def test_seed_rejects_negative() -> None:
    with pytest.raises(ValueError, match="seed"):
        seed_everything(-1)
