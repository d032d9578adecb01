"""MLX's BLAS and LAPACK routed to scipy-openblas32 through trampolines (base_setup/scipy_blas.py):
the assembly, the build and its cache, the fallbacks, and the results of MLX's matmuls and LAPACK
calls in a fresh process."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from base_setup import scipy_blas
from base_setup.backend import _find_one

ROOT = Path(__file__).resolve().parent.parent
LINUX_X86 = sys.platform.startswith("linux") and os.uname().machine == "x86_64"
SCIPY_LIB = _find_one("scipy_openblas32/lib/libscipy_openblas.so") if LINUX_X86 else None
COMPILER = scipy_blas.c_compiler()
needs_scipy = pytest.mark.skipif(
    SCIPY_LIB is None or COMPILER is None,
    reason="scipy-openblas32 (Linux x86_64) and a C compiler to build the trampolines",
)


def test_each_symbol_jumps_through_its_own_slot() -> None:
    source = scipy_blas.trampolines_source(("cblas_sgemm", "sgetrf_"))
    assert "cblas_sgemm:\n    jmp *.Ltable+0(%rip)" in source
    assert "sgetrf_:\n    jmp *.Ltable+8(%rip)" in source
    assert f"{scipy_blas.TABLE_SYMBOL}:\n.Ltable:\n    .zero 16" in source
    assert ".note.GNU-stack" in source  # no executable stack


def test_mlx_symbols_are_libmlx_undefined_blas_and_lapack() -> None:
    """The trampolines cover every BLAS and LAPACK function libmlx.so leaves undefined (a new
    MLX that calls another one would keep the reference BLAS's for it, silently slower)."""
    import mlx.core as mx

    libs = sorted(Path(mx.__file__).parent.glob("lib/libmlx*.so*"))
    if not LINUX_X86 or not libs:
        pytest.skip("libmlx.so is Linux's")
    out = subprocess.run(
        ["nm", "-D", "--undefined-only", str(libs[0])], capture_output=True, text=True
    )
    if out.returncode != 0:
        pytest.skip("nm is not installed")
    undefined = {line.split()[-1] for line in out.stdout.splitlines()}
    blas = {s for s in undefined if s.startswith("cblas_") or s.endswith("_") and "@" not in s}
    blas = {s for s in blas if not s.startswith("_")}
    assert blas == set(scipy_blas.MLX_SYMBOLS)


@pytest.mark.skipif(not LINUX_X86 or COMPILER is None, reason="x86-64 assembly, a C compiler")
def test_the_trampolines_are_built_once_and_then_taken_from_the_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    built = scipy_blas.build_trampolines(("cblas_sgemm",), tmp_path)
    assert built.is_file() and built.parent == tmp_path
    assert [p.name for p in tmp_path.iterdir()] == [built.name]  # no temporary left behind
    monkeypatch.setenv("CC", "/nonexistent/cc")  # a second build would fail: the cache answers
    assert scipy_blas.build_trampolines(("cblas_sgemm",), tmp_path) == built


def test_no_compiler_is_an_os_error_that_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("CC", raising=False)
    monkeypatch.setattr(scipy_blas.shutil, "which", lambda name: None)
    with pytest.raises(OSError, match="no C compiler"):
        scipy_blas.build_trampolines(("cblas_sgemm",), tmp_path)
    monkeypatch.setenv("CC", "false")  # a compiler that fails
    with pytest.raises(OSError, match="could not build the BLAS trampolines"):
        scipy_blas.build_trampolines(("cblas_sgemm",), tmp_path)


_CHECK = """
import os, sys
sys.path.insert(0, os.getcwd())
from base_setup import setup_blas
info = setup_blas()
import mlx.core as mx
import numpy as np
a = mx.random.normal((96, 64)); b = mx.random.normal((64, 80))
square = mx.random.normal((32, 32)) + 8 * mx.eye(32)
mx.eval(a, b, square)
ok_mm = np.allclose(np.array(a @ b), np.array(a) @ np.array(b), atol=1e-4)
inverse = np.array(mx.linalg.inv(square, stream=mx.cpu))
ok_inv = np.allclose(inverse, np.linalg.inv(np.array(square)), atol=1e-4)
print(info.name, ok_mm, ok_inv)
print(info.detail)
"""


def _check(env: dict[str, str]) -> tuple[str, str]:
    out = subprocess.run(
        [sys.executable, "-c", _CHECK],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
        # The suite's own PPO_MLX_BLAS=cmeel (tests/conftest.py) left out: the default path.
        env={**{k: v for k, v in os.environ.items() if k != "PPO_MLX_BLAS"}, **env},
    )
    first, detail = out.stdout.strip().splitlines()[-2:]
    return first, detail


@needs_scipy
def test_a_fresh_process_runs_mlx_matmuls_and_lapack_on_scipy_openblas(tmp_path: Path) -> None:
    first, detail = _check({"XDG_CACHE_HOME": str(tmp_path)})
    assert first == "openblas True True", detail
    assert " through " in detail and str(tmp_path) in detail  # built into this cache
    assert "DYNAMIC_ARCH" in detail


@needs_scipy
def test_without_a_compiler_the_cmeel_wheel_serves_and_says_why(tmp_path: Path) -> None:
    first, detail = _check({"XDG_CACHE_HOME": str(tmp_path), "CC": "false"})
    assert first.endswith("True True"), detail
    assert "scipy-openblas32 not used" in detail and "trampolines" in detail
    first, detail = _check({"PPO_MLX_BLAS": "cmeel"})
    assert first.endswith("True True") and "PPO_MLX_BLAS=cmeel" in detail
