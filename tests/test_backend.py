"""The fast BLAS is active in the test process, and seeding is reproducible."""

import ctypes
import os
import random
import subprocess
import sys
import threading
from pathlib import Path
from types import ModuleType
from typing import Any, Iterator, cast

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from base_setup import backend, blas_info, seed_everything
from base_setup.backend import BlasInfo

ROOT = Path(__file__).resolve().parent.parent
LINUX_X86 = sys.platform.startswith("linux") and "x86_64" in (
    subprocess.run(["uname", "-m"], capture_output=True, text=True).stdout
)


def _loaded_libraries() -> str:
    return Path("/proc/self/maps").read_text()


@pytest.mark.skipif(not LINUX_X86, reason="OpenBLAS is loaded on Linux x86_64 only")
def test_openblas_is_loaded_and_bound() -> None:
    """MLX's ``cblas_sgemm`` resolves, in the global scope, to scipy-openblas32's through its
    trampoline (the default), or to the cmeel wheel's OpenBLAS (its fallback)."""
    from base_setup import scipy_blas

    info = blas_info()
    assert info.name == "openblas", info.detail
    handle = ctypes.CDLL(None)
    sgemm = ctypes.cast(handle.cblas_sgemm, ctypes.c_void_p).value
    if " through " in info.detail:  # scipy-openblas32: the trampoline jumps to its function
        library, trampolines = info.detail.split(" from ")[1].split(" through ")
        loaded = ctypes.CDLL(trampolines.split(";")[0])
        assert sgemm == ctypes.cast(loaded.cblas_sgemm, ctypes.c_void_p).value
        table = (ctypes.c_void_p * len(scipy_blas.MLX_SYMBOLS)).in_dll(
            loaded, scipy_blas.TABLE_SYMBOL
        )
        target = ctypes.CDLL(library).scipy_cblas_sgemm
        slot = scipy_blas.MLX_SYMBOLS.index("cblas_sgemm")
        assert table[slot] == ctypes.cast(target, ctypes.c_void_p).value
        assert "libscipy_openblas" in _loaded_libraries()
    else:
        assert "libopenblas" in _loaded_libraries()
        openblas = ctypes.CDLL(info.detail.split(" from ")[1].split(",")[0].split(";")[0])
        assert sgemm == ctypes.cast(openblas.cblas_sgemm, ctypes.c_void_p).value


_MATMUL_RATE = """
import os, sys, time
sys.path.insert(0, os.getcwd())
import base_setup
base_setup.setup_blas()
import mlx.core as mx
a = mx.random.normal((1024, 1024)); mx.eval(a @ a)
best = float("inf")
for _ in range(3):
    start = time.process_time(); mx.eval(a @ a); best = min(best, time.process_time() - start)
print(2 * 1024**3 / best / 1e9)
"""


def _matmul_gflops(env_extra: dict[str, str]) -> float:
    out = _run_python(_MATMUL_RATE, env_extra)
    return float(out.stdout.strip().splitlines()[-1])


@pytest.mark.slow
@pytest.mark.skipif(not LINUX_X86, reason="OpenBLAS is loaded on Linux x86_64 only")
def test_matmul_runs_far_above_reference_blas_rate() -> None:
    # Same matmul, two processes: with OpenBLAS and with the wheel's reference BLAS
    # (PPO_MLX_BLAS=reference), each timed in the CPU seconds of its own threads (a busy machine
    # stretches the wall time, and changes between the two runs, not the CPU time a matmul
    # costs). A ratio, not an absolute rate; measured here about 15 (OpenBLAS on 2 threads).
    fast = _matmul_gflops({})
    slow = _matmul_gflops({"PPO_MLX_BLAS": "reference"})
    assert fast > 3 * slow, f"OpenBLAS {fast:.1f} vs reference {slow:.1f} GFLOP/s ({blas_info()})"


def _run_python(
    code: str, env_extra: dict[str, str] | None = None, timeout: float | None = None
) -> subprocess.CompletedProcess[str]:
    """Run ``code`` in a fresh interpreter from the repository root (``env_extra`` added to the
    environment); a non-zero exit or ``timeout`` seconds fail the test."""
    return subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, **(env_extra or {})},
        timeout=timeout,
    )


def test_import_order_is_enforced_in_a_fresh_process() -> None:
    """Importing mlx before setup_blas is detected and reported, not silently slow."""
    out = _run_python("import mlx.core, base_setup; print(base_setup.setup_blas().name)")
    assert out.stdout.strip() == ("accelerate" if sys.platform == "darwin" else "reference")
    if LINUX_X86:  # a warning that says what happened and how to fix it
        assert "mlx was imported before base_setup.setup_blas() ran" in out.stderr
        assert "setup_blas()` at the top of your script" in out.stderr


def test_setup_blas_keeps_transformers_from_asking_for_pytorch() -> None:
    """A user's snippet starts with setup_blas(); transformers' "PyTorch was not found" line
    (MLX needs no PyTorch) is not printed, and its other warnings still are."""
    code = (
        "from base_setup import setup_blas; setup_blas()\n"
        "import transformers\n"
        "transformers.utils.logging.get_logger('transformers').warning('still heard')"
    )
    out = _run_python(code)
    assert "PyTorch was not found" not in out.stderr
    assert "still heard" in out.stderr


@pytest.mark.slow
def test_importing_the_packages_has_no_side_effect_and_setup_blas_first_is_fast() -> None:
    """Importing the project's packages loads no BLAS; a script that calls setup_blas() first,
    as every entry point does, gets OpenBLAS."""
    out = _run_python(
        "import pathlib, base_setup, models, ppo_trainer, training\n"
        "from base_setup import backend\n"
        "print(backend._BLAS_INFO is None, 'libopenblas' in pathlib.Path('/proc/self/maps')"
        ".read_text() if pathlib.Path('/proc/self/maps').exists() else False)"
    )
    assert out.stdout.split() == ["True", "False"]
    out = _run_python(
        "from base_setup import setup_blas; setup_blas()\n"
        "import ppo_trainer.ppo_trainer, base_setup; print(base_setup.blas_info().name)"
    )
    assert out.stdout.strip() == ("openblas" if LINUX_X86 else blas_info().name)


@pytest.mark.slow
@pytest.mark.skipif(not LINUX_X86, reason="OpenBLAS is loaded on Linux x86_64 only")
def test_a_model_built_without_setup_blas_warns_once(tiny_model_dir: Path) -> None:
    """A library user's script that imports the packages (so mlx) without calling setup_blas:
    building a model logs one warning that names the fix."""
    out = _run_python(
        "from models.policy_model import PolicyModel\n"
        f"PolicyModel.from_pretrained({str(tiny_model_dir)!r})\n"
        f"PolicyModel.from_pretrained({str(tiny_model_dir)!r})\n"
    )
    assert out.stderr.count("mlx was imported before base_setup.setup_blas() ran") == 1
    assert "from base_setup import setup_blas; setup_blas()" in out.stderr


def backend_info_name() -> str:
    return blas_info().name


def test_missing_libgfortran_falls_back_with_the_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    """No system libgfortran and a NumPy that bundles none (>= 2.5): the reference BLAS, with a
    warning that says how to get the fast one, instead of an import error."""

    def cdll(path: str, mode: int = 0) -> object:
        raise OSError("libgfortran.so.5: cannot open shared object file: No such file or directory")

    monkeypatch.setattr(backend.ctypes, "CDLL", cdll)
    monkeypatch.setattr(
        backend,
        "_find_one",
        lambda pattern: (Path("/x/libopenblas.so.0") if "openblas" in pattern else None),
    )
    info = backend._load_openblas()  # scipy-openblas32's load fails too: cmeel's, then none
    assert info.name == "reference"
    assert "apt install libgfortran5" in info.detail and "numpy<2.5" in info.detail


@pytest.mark.skipif(backend_info_name() != "openblas", reason="OpenBLAS is not loaded here")
def test_numpys_libgfortran_is_loaded_only_when_the_system_lacks_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The libgfortran-from-memfd loader is a fallback: where OpenBLAS loads on its own (the
    system's libgfortran.so.5, here the one already loaded), it is never used; where the
    dynamic linker cannot find libgfortran, it is, and the log line says so."""

    def never() -> str:
        raise AssertionError("NumPy's libgfortran was loaded although OpenBLAS loaded on its own")

    monkeypatch.setattr(backend, "_load_libgfortran_from_numpy", never)
    lib = backend._OPENBLAS["lib"]
    start, ceiling = int(lib.openblas_get_num_threads()), backend._OPENBLAS["max_threads"]
    try:
        # Loaded again while a run under load has one thread set: the ceiling stays the count
        # OpenBLAS started with (it became 1, and every later run with adaptive BLAS off, the
        # golden runs', took one thread: their near-zero KL then missed its recording).
        lib.openblas_set_num_threads(1)
        assert "libgfortran from" not in backend._load_cmeel_wheel().detail
        assert backend._OPENBLAS["max_threads"] == ceiling
    finally:
        lib.openblas_set_num_threads(start)

    real_cdll, failures = backend.ctypes.CDLL, [1]

    def cdll_without_gfortran(path: str, mode: int = 0) -> Any:
        if failures:
            failures.pop()
            raise OSError("libgfortran.so.5: cannot open shared object file")
        return real_cdll(path, mode)

    monkeypatch.setattr(backend.ctypes, "CDLL", cdll_without_gfortran)
    monkeypatch.setattr(backend, "_load_libgfortran_from_numpy", lambda: "/numpy.libs/gf.so")
    assert "libgfortran from /numpy.libs/gf.so" in backend._load_cmeel_wheel().detail


def test_a_forced_openblas_core_on_an_avx512_cpu_is_said() -> None:
    """OPENBLAS_CORETYPE holding OpenBLAS to AVX2 kernels where the CPU has what its SkylakeX
    kernels need is named in the BLAS line, with what to do; nothing otherwise."""
    avx512 = {"avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512dq"}
    note = backend.forced_kernels_note("Haswell", "Haswell", avx512)
    assert "OPENBLAS_CORETYPE=Haswell" in note and "unset OPENBLAS_CORETYPE" in note
    assert "OPENBLAS_CORETYPE=zen" in backend.forced_kernels_note("zen", "Zen", avx512)
    assert backend.forced_kernels_note(None, "Haswell", avx512) == ""  # OpenBLAS chose
    assert backend.forced_kernels_note("", "Haswell", avx512) == ""
    assert backend.forced_kernels_note("SkylakeX", "SkylakeX", avx512) == ""
    assert backend.forced_kernels_note("Haswell", "Haswell", {"avx2", "fma"}) == ""  # no AVX-512


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


# ------------------------------------------------------------------ fast CPU math
from base_setup import fast_layers, fast_math  # noqa: E402
from base_setup.grad_checkpoint import checkpoint_blocks, is_checkpointed  # noqa: E402
from token_attribution.logprob_computer import selective_log_softmax  # noqa: E402
from mlx.utils import tree_flatten, tree_unflatten  # noqa: E402

ON_CPU = mx.default_device().type == mx.DeviceType.cpu


def _rel_err(got: mx.array, want: np.ndarray) -> float:
    got64 = np.array(got, dtype=np.float64)
    return float(np.max(np.abs(got64 - want) / np.maximum(np.abs(want), 1e-30)))


@pytest.mark.skipif(not ON_CPU, reason="the fast functions replace MLX's on the CPU only")
def test_fast_math_is_enabled_and_env_turns_it_off(monkeypatch: pytest.MonkeyPatch) -> None:
    assert fast_math.fast_math_enabled()
    monkeypatch.setenv("PPO_MLX_FAST_MATH", "0")
    assert not fast_math.fast_math_enabled()


def test_fast_exp_matches_float64() -> None:
    rng = np.random.default_rng(0)
    small = rng.uniform(-1, 1, 100_000).astype(np.float32)
    wide = rng.uniform(-87, 88, 100_000).astype(np.float32)
    # float32's own rounding of x limits any exp to about |x| * 6e-8 relative error.
    assert _rel_err(fast_math.exp(mx.array(small)), np.exp(small.astype(np.float64))) < 3e-7
    assert _rel_err(fast_math.exp(mx.array(wide)), np.exp(wide.astype(np.float64))) < 1e-5
    edge = np.array(fast_math.exp(mx.array([-np.inf, -200.0, 0.0, np.nan], dtype=mx.float32)))
    assert edge[0] == 0.0 and edge[1] == 0.0 and edge[2] == 1.0 and np.isnan(edge[3])
    half = fast_math.exp(mx.array([0.5, -2.0], dtype=mx.bfloat16))
    assert half.dtype == mx.bfloat16


def test_exp_shifted_is_exp_of_the_difference_bit_for_bit() -> None:
    """exp(x - m) with the subtraction fused: the same bits as exp of the difference for x <= m,
    masked (-inf, float32's minimum) entries, whole rows of -inf (NaN, as exp gives) and a
    bfloat16 input, whose dtype it keeps."""
    rng = np.random.default_rng(6)
    x = rng.normal(0, 30, (64, 257)).astype(np.float32)
    x[rng.uniform(size=x.shape) < 0.1] = np.finfo(np.float32).min
    x[rng.uniform(size=x.shape) < 0.05] = -np.inf
    x[3] = -np.inf
    xs = mx.array(x)
    m = mx.max(xs, axis=-1, keepdims=True)
    got, want = fast_math.exp_shifted(xs, m), fast_math.exp(xs - m)
    assert mx.array_equal(got, want, equal_nan=True).item()
    assert np.isnan(np.array(got[3])).all() and not np.isnan(np.array(got[:3])).any()
    half = mx.array(x[:4, :8]).astype(mx.bfloat16)
    assert fast_math.exp_shifted(half, half.max(axis=-1, keepdims=True)).dtype == mx.bfloat16


def test_exp_is_mlx_exp_when_fast_math_is_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PPO_MLX_FAST_MATH", "0")
    x = mx.array(np.random.default_rng(2).uniform(-80, 80, 1000).astype(np.float32))
    assert mx.array_equal(fast_math.exp(x), mx.exp(x)).item()
    assert fast_math.exp(mx.array([0.5], dtype=mx.bfloat16)).dtype == mx.bfloat16
    assert mx.array_equal(fast_math.exp_shifted(x, x.max()), mx.exp(x - x.max())).item()
    # the attention too: MLX's exp, not the fused fast core
    rng = np.random.default_rng(7)
    q, k, v = (mx.array(rng.normal(size=(1, 2, 5, 4)).astype(np.float32)) for _ in range(3))
    got = fast_math.scaled_dot_product_attention(q, k, v, scale=0.5, mask="causal")
    scores = mx.where(
        mx.tril(mx.ones((5, 5), dtype=mx.bool_)), (q * 0.5) @ k.swapaxes(-1, -2), -1e30
    )
    want = mx.softmax(scores, axis=-1) @ v
    assert mx.array_equal(got, want).item()


def test_fast_sigmoid_and_swiglu_values_and_gradients() -> None:
    rng = np.random.default_rng(1)
    gate = rng.normal(0, 6, (64, 96)).astype(np.float32)
    up = rng.normal(0, 1, (64, 96)).astype(np.float32)
    g64, u64 = gate.astype(np.float64), up.astype(np.float64)
    sig = 1 / (1 + np.exp(-g64))
    assert _rel_err(fast_math.sigmoid(mx.array(gate)), sig) < 2e-6
    assert _rel_err(fast_math.swiglu(mx.array(gate), mx.array(up)), g64 * sig * u64) < 2e-6

    weights = mx.array(rng.normal(size=(64, 96)).astype(np.float32))
    grads = mx.grad(lambda g, u: (fast_math.swiglu(g, u) * weights).sum(), argnums=(0, 1))(
        mx.array(gate), mx.array(up)
    )
    w = np.array(weights, dtype=np.float64)
    d_gate = w * u64 * sig * (1 + g64 * (1 - sig))  # d silu(g) = s (1 + g (1 - s))
    np.testing.assert_allclose(np.array(grads[0]), d_gate, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(np.array(grads[1]), w * g64 * sig, rtol=1e-4, atol=1e-6)


def test_a_training_step_through_every_fast_function_uses_one_thread() -> None:
    # No MLX array is built or released on a thread of this project's: a value_and_grad through
    # every custom function at training size (above the written-out RoPE's size) starts none.
    rng = np.random.default_rng(7)
    shape = (4, 128, 160)  # 81,920 elements
    gate, up, cot = (mx.array(rng.normal(0, 3, shape).astype(np.float32)) for _ in range(3))
    tokens = mx.array(rng.integers(0, 160, size=shape[:2]))
    threads = threading.active_count()

    def loss(g: mx.array, u: mx.array) -> mx.array:
        parts = (
            fast_math.swiglu(g, u),
            fast_math.softmax(g, axis=-1),
            fast_math.logsumexp(u, axis=-1, keepdims=True),
            fast_math.rope(u, 160, traditional=False, base=1e4, scale=1.0, offset=0),
        )
        total = sum(((p * cot[..., : p.shape[-1]]).sum() for p in parts), mx.array(0.0))
        return total + selective_log_softmax(g, tokens).sum()

    mx.eval(mx.value_and_grad(loss, argnums=(0, 1))(gate, up))
    assert threading.active_count() == threads


def test_the_log_softmax_gather_at_training_size_matches_float64() -> None:
    # The logits path's log-softmax gather calls the fast logsumexp: both custom functions.
    rng = np.random.default_rng(9)
    logits = mx.array(rng.normal(size=(4, 40, 512)).astype(np.float32))  # 81,920 elements
    tokens = mx.array(rng.integers(0, 512, size=(4, 40)))
    x, t = np.array(logits, dtype=np.float64), np.array(tokens)[..., None]
    lse = np.log(np.exp(x).sum(-1, keepdims=True))
    got = np.array(selective_log_softmax(logits, tokens))
    grad = np.array(mx.grad(lambda a: selective_log_softmax(a, tokens).sum())(logits))
    want = -np.exp(x - lse)
    np.put_along_axis(want, t, np.take_along_axis(want, t, -1) + 1, -1)
    assert np.abs(got - (np.take_along_axis(x, t, -1) - lse)[..., 0]).max() < 1e-5
    assert np.abs(grad - want).max() < 1e-5


def test_fast_softmax_and_logsumexp_match_mlx_with_masked_entries() -> None:
    rng = np.random.default_rng(2)
    x = rng.normal(0, 4, (6, 5, 300)).astype(np.float32)
    x[0, 0, :10] = -np.inf
    x[1, 1, :] = -np.inf  # a fully masked row: logsumexp -inf, not NaN
    logits = mx.array(x)
    lse = np.array(fast_math.logsumexp(logits, axis=-1))
    assert lse[1, 1] == -np.inf
    finite = np.isfinite(lse)
    np.testing.assert_allclose(
        lse[finite], np.array(mx.logsumexp(logits, axis=-1))[finite], rtol=1e-6, atol=1e-5
    )
    kept = mx.array(np.where(np.isinf(x), -30.0, x))  # softmax of a -inf row is NaN either way
    np.testing.assert_allclose(
        np.array(fast_math.softmax(kept, axis=1)), np.array(mx.softmax(kept, axis=1)), atol=1e-6
    )
    w = mx.array(rng.normal(size=(6, 5, 300)).astype(np.float32))

    def ours(z: mx.array) -> mx.array:
        return (fast_math.logsumexp(z, axis=-1, keepdims=True) * w).sum() + (
            fast_math.softmax(z, axis=-1) * w
        ).sum()

    def theirs(z: mx.array) -> mx.array:
        return (mx.logsumexp(z, axis=-1, keepdims=True) * w).sum() + (
            mx.softmax(z, axis=-1) * w
        ).sum()

    np.testing.assert_allclose(
        np.array(mx.grad(ours)(kept)), np.array(mx.grad(theirs)(kept)), rtol=1e-4, atol=1e-5
    )


@pytest.mark.parametrize("mask_kind", ["none", "causal", "bool", "additive", "per_head"])
@pytest.mark.parametrize("length", [1, 5, 7])
def test_fast_attention_matches_mlx(mask_kind: str, length: int) -> None:
    """Values and the gradients of queries, keys and values (eager and compiled) equal MLX's
    own, with fewer queries than keys (a prefill after a cache) and as many."""
    rng = np.random.default_rng(3)
    b, h, hkv, s, d = 2, 4, 2, 7, 16
    q = mx.array(rng.normal(size=(b, h, length, d)).astype(np.float32))
    k = mx.array(rng.normal(size=(b, hkv, s, d)).astype(np.float32))
    v = mx.array(rng.normal(size=(b, hkv, s, d)).astype(np.float32))
    mask: mx.array | str | None = {
        "none": None,
        "causal": "causal",
        "bool": mx.array(rng.uniform(size=(b, 1, length, s)) > 0.3),
        "additive": mx.array(rng.normal(size=(length, s)).astype(np.float32)),
        "per_head": mx.array(rng.uniform(size=(b, h, length, s)) > 0.3),
    }[mask_kind]
    if isinstance(mask, mx.array) and mask.dtype == mx.bool_:
        mask[..., 0] = True  # every query sees a key (MLX's own gives NaN otherwise)
    got = fast_math.scaled_dot_product_attention(q, k, v, scale=0.25, mask=mask)
    want = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.25, mask=mask)
    np.testing.assert_allclose(np.array(got), np.array(want), atol=2e-6)
    # A weighted sum, so that every output's cotangent differs (a plain sum would hide a
    # gradient that mixes up the rows or the value columns).
    cot = mx.array(rng.normal(size=got.shape).astype(np.float32))

    def loss(fn: Any) -> Any:
        return lambda a, kk, vv: (fn(a, kk, vv, scale=0.25, mask=mask) * cot).sum()

    grads = mx.grad(loss(fast_math.scaled_dot_product_attention), argnums=(0, 1, 2))(q, k, v)
    grads_want = mx.grad(loss(mx.fast.scaled_dot_product_attention), argnums=(0, 1, 2))(q, k, v)
    for g, gw in zip(grads, grads_want):
        np.testing.assert_allclose(np.array(g), np.array(gw), atol=1e-5)
    compiled = mx.compile(mx.grad(loss(fast_math.scaled_dot_product_attention), argnums=(0, 1, 2)))
    for g, gw in zip(compiled(q, k, v), grads_want):
        np.testing.assert_allclose(np.array(g), np.array(gw), atol=1e-5)


@pytest.mark.parametrize("mask_kind", ["none", "bool", "additive", "per_head", "left_padding"])
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_one_query_attention_matches_mlx(mask_kind: str, dtype: mx.Dtype) -> None:
    """A decoding step's attention (one query, grouped heads, a cache slice as keys): values
    and gradients equal MLX's own."""
    from mlx_lm.models.base import create_causal_mask

    rng = np.random.default_rng(4)
    b, h, hkv, s, d = 3, 6, 2, 9, 16
    q = mx.array(rng.normal(size=(b, h, 1, d)).astype(np.float32)).astype(dtype)
    buffer = mx.array(rng.normal(size=(2, b, hkv, 16, d)).astype(np.float32)).astype(dtype)
    k, v = buffer[0, :, :, :s], buffer[1, :, :, :s]  # (B, Hkv, S, D): views, as a KV cache gives
    mask: mx.array | None = {
        "none": None,
        "bool": mx.array(rng.uniform(size=(b, 1, 1, s)) > 0.3),
        "additive": mx.array(rng.normal(size=(1, s)).astype(np.float32)).astype(dtype),
        "per_head": mx.array(rng.uniform(size=(b, h, 1, s)) > 0.3),
        "left_padding": create_causal_mask(1, offset=s - 1, left_padding=mx.array([0, 2, 5])),
    }[mask_kind]
    if mask is not None and mask.dtype == mx.bool_:
        mask[..., -1] = True  # every query sees a key (MLX's own gives NaN otherwise)
    got = fast_math.one_query_attention(q, k, v, scale=0.25, mask=mask)
    want = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.25, mask=mask)
    assert got.dtype == want.dtype and got.shape == want.shape
    atol = 2e-6 if dtype == mx.float32 else 2e-2
    np.testing.assert_allclose(_f32(got), _f32(want), atol=atol)

    def total(fn: Any) -> Any:
        return lambda a, kk, vv: fn(a, kk, vv, scale=0.25, mask=mask).astype(mx.float32).sum()

    grads = mx.grad(total(fast_math.one_query_attention), argnums=(0, 1, 2))(q, k, v)
    grads_want = mx.grad(total(mx.fast.scaled_dot_product_attention), argnums=(0, 1, 2))(q, k, v)
    for g, gw in zip(grads, grads_want):
        np.testing.assert_allclose(_f32(g), _f32(gw), atol=max(atol, 1e-5))


def _f32(a: mx.array) -> np.ndarray:
    return np.array(a.astype(mx.float32))


def test_one_query_attention_rejects_several_queries() -> None:
    q, kv = mx.ones((1, 2, 3, 4)), mx.ones((1, 1, 3, 4))
    with pytest.raises(ValueError, match="one query position"):
        fast_math.one_query_attention(q, kv, kv, scale=1.0)


def test_fast_attention_left_padding_rows_match_a_select_masked_softmax() -> None:
    """Rows whose every key is masked (left padding's first positions): values the mean of the
    values and no gradient to their queries or to the keys, as a select-masked softmax gives
    (the fast attention adds the mask instead of selecting it)."""
    from mlx_lm.models.base import create_causal_mask

    rng = np.random.default_rng(5)
    b, h, hkv, length, d = 3, 4, 2, 6, 8
    q, k, v = (
        mx.array(rng.normal(size=shape).astype(np.float32))
        for shape in ((b, h, length, d), (b, hkv, length, d), (b, hkv, length, d))
    )
    mask = create_causal_mask(length, left_padding=mx.array([0, 2, 4]))  # (B, 1, L, S)
    assert not bool(mask[2, 0, 1].any())  # row 1 of the third sequence sees nothing

    def naive(q: mx.array, k: mx.array, v: mx.array) -> mx.array:
        grouped = mx.repeat(k, h // hkv, axis=1), mx.repeat(v, h // hkv, axis=1)
        scores = mx.where(
            mask, (q @ grouped[0].swapaxes(-1, -2)) * 0.5, float(np.finfo(np.float32).min)
        )
        return mx.softmax(scores, axis=-1, precise=True) @ grouped[1]

    cot = mx.array(rng.normal(size=(b, h, length, d)).astype(np.float32))

    def loss(fn: Any) -> Any:
        return lambda a, kk, vv: (fn(a, kk, vv) * cot).sum()

    def fast(q: mx.array, k: mx.array, v: mx.array) -> mx.array:
        return fast_math.scaled_dot_product_attention(q, k, v, scale=0.5, mask=mask)

    np.testing.assert_allclose(np.array(fast(q, k, v)), np.array(naive(q, k, v)), atol=2e-6)
    grads = mx.grad(loss(fast), argnums=(0, 1, 2))(q, k, v)
    for g, gw in zip(grads, mx.grad(loss(naive), argnums=(0, 1, 2))(q, k, v)):
        np.testing.assert_allclose(np.array(g), np.array(gw), atol=1e-5)
    assert not np.array(grads[0])[2, :, :4].any()  # the padded rows' queries: exactly 0


def test_fast_attention_fully_masked_row_is_finite() -> None:
    q = mx.ones((1, 2, 2, 4))
    k = mx.ones((1, 1, 3, 4))
    v = mx.arange(12, dtype=mx.float32).reshape(1, 1, 3, 4)
    mask = mx.array([[False, False, False], [True, True, False]])  # (L, S)
    out = np.array(fast_math.scaled_dot_product_attention(q, k, v, scale=1.0, mask=mask))
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out[0, :, 1], [[2.0, 3.0, 4.0, 5.0]] * 2, atol=1e-6)


@pytest.mark.parametrize("shape", [(16, 1, 64), (3, 5, 4, 32), (2, 7, 200), (40, 256)])
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_rms_norm_matches_mlx_values_and_gradients(shape: tuple[int, ...], dtype: mx.Dtype) -> None:
    """Small inputs take the compiled function, the largest MLX's own: both equal it."""
    rng = np.random.default_rng(7)
    x = mx.array(rng.normal(0, 3, shape).astype(np.float32)).astype(dtype)
    weight = mx.array(rng.normal(1, 0.2, shape[-1]).astype(np.float32)).astype(dtype)
    got, want = fast_math.rms_norm(x, weight, 1e-5), mx.fast.rms_norm(x, weight, 1e-5)
    assert got.dtype == want.dtype == dtype
    assert mx.array_equal(got, want).item()  # MLX's formula, bit for bit

    cot = mx.array(rng.normal(size=shape).astype(np.float32)).astype(dtype)
    ours = mx.grad(lambda a, w: (fast_math.rms_norm(a, w, 1e-5) * cot).sum(), argnums=(0, 1))
    theirs = mx.grad(lambda a, w: (mx.fast.rms_norm(a, w, 1e-5) * cot).sum(), argnums=(0, 1))
    tol = 1e-5 if dtype == mx.float32 else 5e-2
    for g, h in zip(ours(x, weight), theirs(x, weight)):
        g64, h64 = np.array(g.astype(mx.float32)), np.array(h.astype(mx.float32))
        np.testing.assert_allclose(g64, h64, rtol=tol, atol=tol * np.abs(h64).max())


def test_rms_norm_sizes_pick_the_compiled_function_only_when_small() -> None:
    assert fast_math._MAX_COMPILED_RMS_NORM >= 16 * 256  # a decoding step of the tiny model
    assert fast_math._MAX_COMPILED_RMS_NORM < 736 * 256  # a 16 x 46 forward pass: MLX's own


@pytest.mark.parametrize(
    "offset", [0, 5, "scalar_array", "per_sequence"], ids=["0", "5", "scalar", "per_sequence"]
)
@pytest.mark.parametrize("dims", [32, 24])  # the whole head, or a partial rotary part of it
@pytest.mark.parametrize("scale", [1.0, 0.5])
# 400 positions: from fast_math._MIN_ROPE_CUSTOM_GRAD elements, the rotation's gradient written out
@pytest.mark.parametrize("length", [5, 400])
def test_rope_matches_mlx_values_and_gradients(
    offset: int | str, dims: int, scale: float, length: int
) -> None:
    rng = np.random.default_rng(8)
    batch, heads, head_dim = 3, 2, 32
    assert (batch * heads * length * head_dim >= fast_math._MIN_ROPE_CUSTOM_GRAD) == (length == 400)
    x = mx.array(rng.normal(size=(batch, heads, length, head_dim)).astype(np.float32))
    arrays = {
        "scalar_array": mx.array(7),
        "per_sequence": mx.array([0, 4, 11]),  # a batched KV cache's per-row offsets
    }
    off: int | mx.array = arrays[offset] if isinstance(offset, str) else offset

    def ours(a: mx.array) -> mx.array:
        return fast_math.rope(a, dims, traditional=False, base=1e4, scale=scale, offset=off)

    def theirs(a: mx.array) -> mx.array:
        return mx.fast.rope(a, dims, traditional=False, base=1e4, scale=scale, offset=off)

    assert mx.array_equal(ours(x), theirs(x)).item()  # bit for bit
    cot = mx.array(rng.normal(size=x.shape).astype(np.float32))
    np.testing.assert_allclose(
        np.array(mx.grad(lambda a: (ours(a) * cot).sum())(x)),
        np.array(mx.grad(lambda a: (theirs(a) * cot).sum())(x)),
        atol=1e-5,
    )
    one = mx.array(rng.normal(size=(batch, heads, 1, head_dim)).astype(np.float16))
    assert ours(one).dtype == mx.float16
    assert mx.array_equal(ours(one), theirs(one)).item()  # float16 too, bit for bit


def test_traditional_rope_is_mlx_rope() -> None:
    x = mx.array(np.random.default_rng(9).normal(size=(2, 2, 4, 16)).astype(np.float32))
    got = fast_math.rope(x, 16, traditional=True, base=1e4, scale=1.0, offset=3)
    want = mx.fast.rope(x, 16, traditional=True, base=1e4, scale=1.0, offset=3)
    assert mx.array_equal(got, want).item()


@pytest.mark.skipif(not ON_CPU, reason="the fast functions replace MLX's on the CPU only")
def test_accelerated_model_matches_mlx_functions(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A tiny qwen3's logits and gradients with the fast functions equal MLX's own."""
    from mlx.utils import tree_flatten

    from models.policy_model import PolicyModel

    from mlx_lm.models import qwen3

    policy = PolicyModel.from_pretrained(tiny_model_dir)
    layers = [type(m) for _, m in policy.model.named_modules()]
    if fast_math.fast_math_enabled():  # every norm, RoPE, MLP and attention: the fast ones
        assert not {nn.RMSNorm, nn.RoPE, qwen3.MLP, qwen3.Attention} & set(layers)
        assert fast_layers._FastRMSNorm in layers and fast_layers._FastRoPE in layers
        assert {"FastMLP", "FastAttention"} <= {t.__name__ for t in layers}
    tokens = mx.array(np.random.default_rng(4).integers(0, 500, (3, 11)))

    def loss(model: nn.Module) -> mx.array:
        return (model(tokens)[:, 3:] ** 2).mean()

    def run() -> tuple[mx.array, dict]:
        value, grads = nn.value_and_grad(policy, loss)(policy)
        return policy(tokens), dict(tree_flatten(grads))

    fast_logits, fast_grads = run()
    monkeypatch.setenv("PPO_MLX_FAST_MATH", "0")  # the same modules defer to MLX's functions
    logits, grads = run()
    np.testing.assert_allclose(np.array(fast_logits), np.array(logits), atol=1e-4)
    for name, g in grads.items():
        scale = float(mx.abs(g).max()) + 1e-12
        assert float(mx.abs(fast_grads[name] - g).max()) / scale < 1e-4, name


@pytest.mark.skipif(not ON_CPU, reason="the fast functions replace MLX's on the CPU only")
@pytest.mark.parametrize("quantized", [False, True])
def test_fast_lora_layers_match_mlx_lm(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch, quantized: bool
) -> None:
    """A LoRA policy's layers are the fast LoRALinear (the adapter product accumulated by
    ``addmm``); its logits and adapter gradients equal mlx-lm's layer's (same modules with
    ``PPO_MLX_FAST_MATH=0``), on a float and a 4-bit base; dropout acts on the adapter's input
    only, as in mlx-lm's."""
    from mlx.utils import tree_flatten
    from mlx_lm.tuner.lora import LoRALinear

    from base_setup.lora_setup import LoraSettings, lora_modules
    from models.policy_model import PolicyModel

    lora = LoraSettings(r=4, alpha=8.0, dropout=0.0)
    policy = PolicyModel.from_pretrained(tiny_model_dir, lora=lora)
    if quantized:
        nn.quantize(
            policy.model,
            group_size=32,
            bits=4,
            class_predicate=lambda _, m: isinstance(m, nn.Linear) and m.weight.shape[-1] % 32 == 0,
        )
    adapted = lora_modules(policy.model)
    assert adapted and all(type(m).__name__ == "FastLoRALinear" for _, m in adapted)
    if quantized:
        assert all(isinstance(m.linear, nn.QuantizedLinear) for _, m in adapted)
    assert all(isinstance(m, LoRALinear) for _, m in adapted)
    rng = np.random.default_rng(5)
    for _, module in adapted:  # lora_b starts at 0: make the adapters count
        module.lora_b = mx.array(rng.normal(0, 0.05, module.lora_b.shape).astype(np.float32))
    tokens = mx.array(rng.integers(0, 500, (3, 11)))

    def loss(model: nn.Module) -> mx.array:
        return (model(tokens)[:, 3:] ** 2).mean()

    def run() -> tuple[mx.array, dict]:
        _, grads = nn.value_and_grad(policy, loss)(policy)
        return policy(tokens), dict(tree_flatten(grads))

    fast_logits, fast_grads = run()
    monkeypatch.setenv("PPO_MLX_FAST_MATH", "0")  # mlx-lm's y + (scale * z)
    logits, grads = run()
    assert set(grads) == set(fast_grads) and len(grads) == 2 * len(adapted)
    np.testing.assert_allclose(np.array(fast_logits), np.array(logits), atol=1e-4)
    for name, g in grads.items():
        scale = float(mx.abs(g).max()) + 1e-12
        assert float(mx.abs(fast_grads[name] - g).max()) / scale < 1e-4, name

    # Dropout: the base layer sees the input itself, the adapter its dropout (mlx-lm's rule).
    monkeypatch.delenv("PPO_MLX_FAST_MATH")
    _, module = adapted[0]
    module.dropout = nn.Dropout(0.5)
    module.train()
    x = mx.array(
        rng.normal(size=(2, 5, module.linear.weight.shape[-1] * (8 if quantized else 1))).astype(
            np.float32
        )
    )
    mx.random.seed(3)
    fast = module(x)
    mx.random.seed(3)
    want = LoRALinear.__call__(cast(LoRALinear, module), x)
    np.testing.assert_allclose(np.array(fast), np.array(want), atol=1e-5)


def test_small_inputs_take_mlx_functions(monkeypatch: pytest.MonkeyPatch) -> None:
    """Below the size threshold (a decoding step of a few sequences) swiglu is MLX's own."""
    calls: list[int] = []
    real = fast_math._swiglu_fast

    def counting(gate: mx.array, x: mx.array) -> object:
        calls.append(gate.size)
        return real(gate, x)

    monkeypatch.setattr(fast_math, "_swiglu_fast", counting)
    small = mx.ones((4, 8))
    big = mx.ones((1, fast_math._MIN_FAST_SWIGLU))
    mx.eval(fast_math.swiglu(small, small), fast_math.swiglu(big, big))
    assert calls == ([big.size] if fast_math.fast_math_enabled() else [])


@pytest.fixture
def default_cache_limit(monkeypatch: pytest.MonkeyPatch) -> Iterator[ModuleType]:
    """MLX's CPU cache limit at its default and setup_cpu_buffer_cache not yet run; restored."""
    monkeypatch.setattr(backend, "_CACHE_STATE", {})
    monkeypatch.delenv("PPO_MLX_CPU_CACHE_MB", raising=False)
    before = mx.set_cache_limit(backend.MLX_CPU_DEFAULT_CACHE_BYTES)
    yield backend
    mx.set_cache_limit(before)


def _cache_limit() -> int:
    limit = mx.set_cache_limit(0)
    mx.set_cache_limit(limit)
    return limit


def test_cpu_buffer_cache_takes_mlxs_limit(default_cache_limit: ModuleType) -> None:
    backend = default_cache_limit
    assert backend.setup_cpu_buffer_cache() == backend.CPU_CACHE_BYTES
    assert _cache_limit() == backend.CPU_CACHE_BYTES == backend.MLX_CPU_DEFAULT_CACHE_BYTES
    mx.set_cache_limit(123 << 20)  # idempotent: a second call changes nothing
    assert backend.setup_cpu_buffer_cache() == backend.CPU_CACHE_BYTES
    assert _cache_limit() == 123 << 20


def test_release_cached_buffers_empties_the_cache(default_cache_limit: ModuleType) -> None:
    backend = default_cache_limit
    backend.setup_cpu_buffer_cache()
    x = mx.ones((1 << 20,))  # 4 MiB
    mx.eval(x)
    del x  # freed into the cache
    assert mx.get_cache_memory() >= 4 << 20
    backend.release_cached_buffers()
    assert mx.get_cache_memory() == 0
    assert _cache_limit() == backend.CPU_CACHE_BYTES


def test_generation_buffer_cache_is_emptied_before_and_after(
    default_cache_limit: ModuleType,
) -> None:
    backend = default_cache_limit
    backend.setup_cpu_buffer_cache()
    left = mx.ones((1 << 20,))  # what the work before the generation freed
    mx.eval(left)
    del left
    with backend.generation_buffer_cache():
        assert mx.get_cache_memory() == 0
        x = mx.ones((1 << 20,))
        mx.eval(x)
        del x
        assert mx.get_cache_memory() >= 4 << 20
    assert mx.get_cache_memory() == 0
    assert _cache_limit() == backend.CPU_CACHE_BYTES


def test_release_cached_buffers_keeps_a_fixed_limit(
    default_cache_limit: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    backend = default_cache_limit
    monkeypatch.setenv("PPO_MLX_CPU_CACHE_MB", "48")
    backend.setup_cpu_buffer_cache()
    x = mx.ones((1 << 20,))
    mx.eval(x)
    del x
    backend.release_cached_buffers()
    assert mx.get_cache_memory() == 0
    assert _cache_limit() == 48 << 20


def test_release_cached_buffers_leaves_the_callers_cache(default_cache_limit: ModuleType) -> None:
    backend = default_cache_limit
    mx.set_cache_limit(64 << 20)
    assert backend.setup_cpu_buffer_cache() is None
    x = mx.ones((1 << 20,))
    mx.eval(x)
    del x
    backend.release_cached_buffers()
    assert mx.get_cache_memory() >= 4 << 20
    mx.clear_cache()


def test_cpu_buffer_cache_keeps_the_callers_limit(default_cache_limit: ModuleType) -> None:
    backend = default_cache_limit
    mx.set_cache_limit(64 << 20)
    assert backend.setup_cpu_buffer_cache() is None
    assert _cache_limit() == 64 << 20


def test_cpu_buffer_cache_env(
    default_cache_limit: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    backend = default_cache_limit
    monkeypatch.setenv("PPO_MLX_CPU_CACHE_MB", "48")
    assert backend.setup_cpu_buffer_cache() == 48 << 20
    assert _cache_limit() == 48 << 20
    monkeypatch.setattr(backend, "_CACHE_STATE", {})
    monkeypatch.setenv("PPO_MLX_CPU_CACHE_MB", "lots")
    with pytest.raises(ValueError, match="PPO_MLX_CPU_CACHE_MB='lots' is not a number"):
        backend.setup_cpu_buffer_cache()
    monkeypatch.setenv("PPO_MLX_CPU_CACHE_MB", "inf")
    with pytest.raises(ValueError, match="PPO_MLX_CPU_CACHE_MB='inf' is not a number"):
        backend.setup_cpu_buffer_cache()


def test_cpu_buffer_cache_only_on_the_cpu_device(default_cache_limit: ModuleType) -> None:
    if not mx.is_available(mx.gpu):
        pytest.skip("needs a GPU device to switch to")
    backend = default_cache_limit
    previous = mx.default_device()
    mx.set_default_device(mx.gpu)
    try:
        assert backend.setup_cpu_buffer_cache() is None
    finally:
        mx.set_default_device(previous)
    assert _cache_limit() == backend.MLX_CPU_DEFAULT_CACHE_BYTES


@pytest.mark.parametrize(
    ("other", "cpus", "max_threads", "want"),
    [
        (0.0, 2, 2, 2),  # quiet: every thread
        (0.4, 2, 2, 2),  # a little background work: still both
        (0.6, 2, 2, 1),  # more than half a core taken: one
        (1.0, 2, 2, 1),
        (2.0, 2, 2, 1),  # never below one
        (3.7, 16, 16, 12),
        (0.0, 16, 8, 8),  # never above what OpenBLAS started with
        (-0.2, 2, 2, 2),  # a negative estimate (clock noise) counts as quiet
    ],
)
def test_blas_threads_for_load(other: float, cpus: int, max_threads: int, want: int) -> None:
    from base_setup.backend import blas_threads_for_load

    assert blas_threads_for_load(other, cpus, max_threads) == want


@pytest.mark.skipif(not LINUX_X86, reason="OpenBLAS is loaded on Linux x86_64 only")
def test_adapt_blas_threads_follows_other_processes_load(monkeypatch: pytest.MonkeyPatch) -> None:
    """Samples of (machine busy, own, wall) CPU seconds: others using ~1.5 of 2 cores bring the
    threads to 1, a quiet interval back to the start count; opting out leaves them alone."""
    lib = backend._OPENBLAS["lib"]
    start = int(lib.openblas_get_num_threads())
    samples = iter(
        [
            (100.0, 10.0, 0.0),
            (103.5, 12.0, 1.0),  # 3.5 busy - 2.0 own: others 1.5 cores
            (105.5, 14.0, 2.0),  # 2.0 busy - 2.0 own: quiet
            (105.6, 14.0, 2.1),  # 0.1 s later: too short to judge
        ]
    )
    monkeypatch.setattr(backend, "_cpu_sample", lambda: next(samples))
    monkeypatch.setattr(backend.os, "cpu_count", lambda: 2)
    monkeypatch.setitem(backend._OPENBLAS, "max_threads", 2)
    monkeypatch.delitem(backend._OPENBLAS, "sample", raising=False)
    monkeypatch.setenv("PPO_MLX_ADAPTIVE_BLAS", "step")
    try:
        assert backend.adapt_blas_threads() is None  # the first sample
        assert backend.adapt_blas_threads() == 1
        assert int(lib.openblas_get_num_threads()) == 1
        assert backend.adapt_blas_threads() == 2
        assert int(lib.openblas_get_num_threads()) == 2
        assert backend.adapt_blas_threads() == 2
        monkeypatch.setenv("PPO_MLX_ADAPTIVE_BLAS", "0")
        assert backend.adapt_blas_threads() is None
        monkeypatch.setenv("PPO_MLX_ADAPTIVE_BLAS", "run")  # the default: fixed per run
        assert backend.adapt_blas_threads() is None
    finally:
        lib.openblas_set_num_threads(start)
        backend._OPENBLAS.pop("sample", None)


@pytest.mark.skipif(not LINUX_X86 or not ON_CPU, reason="OpenBLAS and MLX's CPU device")
def test_side_by_side_splits_the_blas_threads_and_restores_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Two lanes on 2 BLAS threads: 1 thread each inside, the run's count back afterwards (also
    after an exception); values equal those computed on the default stream; one lane, one
    thread or PPO_MLX_CPU_STREAMS=off leave the count and the stream alone."""
    lib = backend._OPENBLAS["lib"]
    start = int(lib.openblas_get_num_threads())
    rng = np.random.default_rng(8)
    a, b = (mx.array(rng.normal(size=(64, 96)).astype(np.float32)) for _ in range(2))
    want = [mx.exp(a @ b.T).sum(axis=1), (a.T @ b).max(axis=0)]
    try:
        lib.openblas_set_num_threads(2)
        with backend.side_by_side(2) as (first, second):
            assert int(lib.openblas_get_num_threads()) == 1
            with first:
                x = mx.exp(a @ b.T).sum(axis=1)
            with second:
                y = (a.T @ b).max(axis=0)
            mx.eval(x, y)
        assert int(lib.openblas_get_num_threads()) == 2
        np.testing.assert_allclose(np.array(x), np.array(want[0]), rtol=1e-6)
        np.testing.assert_allclose(np.array(y), np.array(want[1]), rtol=1e-6)
        with pytest.raises(RuntimeError, match="inside"):
            with backend.side_by_side(2) as (first, _):
                with first:
                    mx.async_eval(mx.exp(a @ b.T))
                raise RuntimeError("inside")
        assert int(lib.openblas_get_num_threads()) == 2
        for count, threads, env in ((1, 2, "on"), (2, 1, "on"), (2, 2, "off")):
            lib.openblas_set_num_threads(threads)
            monkeypatch.setenv("PPO_MLX_CPU_STREAMS", env)
            with backend.side_by_side(count) as lanes:
                assert len(lanes) == count
                assert int(lib.openblas_get_num_threads()) == threads
                with lanes[0]:
                    z = a @ b.T
                assert z.shape == (64, 64)
        monkeypatch.setenv("PPO_MLX_CPU_STREAMS", "sometimes")
        with pytest.raises(ValueError, match="PPO_MLX_CPU_STREAMS"):
            with backend.side_by_side(2):
                pass
    finally:
        lib.openblas_set_num_threads(start)


@pytest.mark.skipif(not LINUX_X86 or not ON_CPU, reason="OpenBLAS and MLX's CPU device")
def test_decoding_threads_leave_the_python_thread_a_core(monkeypatch: pytest.MonkeyPatch) -> None:
    """Inside, OpenBLAS and the native kernels run on one core fewer than the process has (at
    least one); the run's count is back afterwards, also after an exception. Disabled, with a
    count that already leaves a core free, or under plain MLX, the count is left alone."""
    from base_setup import backend, native
    from base_setup.plain import plain_mlx_scope

    lib = backend._OPENBLAS["lib"]
    start = int(lib.openblas_get_num_threads())
    a = mx.ones((32, 32))
    try:
        for cpus, threads, inside in ((2, 2, 1), (4, 4, 3), (4, 2, 2), (1, 1, 1), (8, 3, 3)):
            monkeypatch.setattr(native, "process_cpus", lambda: cpus)
            backend._set_blas_threads(lib, threads)
            with backend.decoding_threads() as count:
                assert int(lib.openblas_get_num_threads()) == inside
                assert native._STATE["threads"] == inside
                assert count == (None if inside == threads else inside)
                mx.eval(a @ a)
            assert int(lib.openblas_get_num_threads()) == threads
            assert native._STATE["threads"] == threads
        monkeypatch.setattr(native, "process_cpus", lambda: 2)
        backend._set_blas_threads(lib, 2)
        with pytest.raises(RuntimeError, match="inside"):
            with backend.decoding_threads():
                mx.async_eval(a @ a)
                raise RuntimeError("inside")
        assert int(lib.openblas_get_num_threads()) == 2
        with backend.decoding_threads(enabled=False) as count:
            assert count is None and int(lib.openblas_get_num_threads()) == 2
        with plain_mlx_scope(True), backend.decoding_threads() as count:
            assert count is None and int(lib.openblas_get_num_threads()) == 2
    finally:
        backend._set_blas_threads(lib, start)


def _cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far (/proc/<pid>/stat)."""
    import os

    with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="needs Linux /proc")
def test_a_running_child_or_grandchild_counts_as_this_process(tmp_path: Path) -> None:
    """MLX's JIT compiler runs as a grandchild (g++ -> cc1plus) while it compiles: its CPU time
    was counted as other load until it finished, so a compile during the load sample took BLAS
    threads away from the run."""
    import os
    import signal
    import time

    started = tmp_path / "started"
    busy = (
        f"import os, pathlib; pathlib.Path({str(started)!r}).write_text(str(os.getpid()))\n"
        "while True: pass"
    )
    # sh waits for python: python is a grandchild of this process, as cc1plus is.
    child = subprocess.Popen(["sh", "-c", '"$0" -c "$1"; true', sys.executable, busy])
    grandchild = 0
    try:
        deadline = time.monotonic() + 60
        while not (started.exists() and started.read_text()):
            assert child.poll() is None and time.monotonic() < deadline, "the child did not start"
            time.sleep(0.02)
        grandchild = int(started.read_text())
        # The grandchild's own CPU time, read after the first sample and before the second:
        # whatever share of the machine it gets, this process's time grows by at least that.
        first = backend._cpu_sample()
        spent_before = _cpu_seconds(grandchild)
        spent = 0.0
        while spent < 0.2:
            assert time.monotonic() < deadline, f"the grandchild ran {spent:.2f} s in 60 s"
            time.sleep(0.05)
            spent = _cpu_seconds(grandchild) - spent_before
        now = backend._cpu_sample()
        assert first is not None and now is not None
        tick = 1.0 / os.sysconf("SC_CLK_TCK")
        assert now[1] - first[1] >= spent - tick, (first, now, spent)
    finally:
        if grandchild:
            os.kill(grandchild, signal.SIGKILL)
        child.kill()
        child.wait()


@pytest.mark.skipif(not LINUX_X86, reason="OpenBLAS is loaded on Linux x86_64 only")
def test_a_run_fixes_its_blas_threads_and_a_resumed_run_takes_them_back(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Fresh: fitted to the load once (a child's CPU time is this run's); resumed: the
    checkpoint's count whatever the load, so resumed matmuls sum in the same order."""
    lib = backend._OPENBLAS["lib"]
    start = int(lib.openblas_get_num_threads())
    monkeypatch.setattr(backend.os, "cpu_count", lambda: 2)
    monkeypatch.setitem(backend._OPENBLAS, "max_threads", 2)
    monkeypatch.setattr(backend.time, "sleep", lambda seconds: None)
    try:
        busy = iter([(100.0, 10.0, 0.0), (101.6, 10.1, 1.0)])  # others: 1.5 cores
        monkeypatch.setattr(backend, "_cpu_sample", lambda: next(busy))
        assert backend.run_blas_threads() == 1 and int(lib.openblas_get_num_threads()) == 1
        quiet = iter([(100.0, 10.0, 0.0), (101.9, 11.9, 1.0)])  # all of it our own
        monkeypatch.setattr(backend, "_cpu_sample", lambda: next(quiet))
        assert backend.run_blas_threads() == 2
        # Resumed on a quiet machine from a run that had one thread: one thread again.
        assert backend.run_blas_threads(saved=1) == 1 and int(lib.openblas_get_num_threads()) == 1
        monkeypatch.setenv("PPO_MLX_ADAPTIVE_BLAS", "off")
        assert backend.run_blas_threads() == 2
        monkeypatch.setenv("PPO_MLX_ADAPTIVE_BLAS", "sometimes")
        with pytest.raises(ValueError, match="run .*step or off"):
            backend.run_blas_threads()
    finally:
        lib.openblas_set_num_threads(start)


# ------------------------------------------- the fast layers: our model instances only, guarded
def _layer_types(model: Any) -> set[type]:
    return {type(m) for _, m in model.named_modules()}


def _fast_layer_types(model: Any) -> set[type]:
    return {t for t in _layer_types(model) if t.__module__ == fast_layers.__name__}


@pytest.mark.skipif(not ON_CPU, reason="the fast functions replace MLX's on the CPU only")
def test_a_model_loaded_with_mlx_lm_stays_untouched(tiny_model_dir: Path) -> None:
    """Accelerating our PolicyModel changes neither mlx-lm's modules nor a model the user loads
    with mlx_lm.load in the same process (before or after)."""
    import mlx_lm
    from mlx_lm.models import activations, base, qwen3

    from models.policy_model import PolicyModel

    before = mlx_lm.load(str(tiny_model_dir))[0]
    tokens = mx.array(np.random.default_rng(5).integers(0, 500, (4, 40)))
    logits_before = before(tokens)
    mx.eval(logits_before)

    policy = PolicyModel.from_pretrained(tiny_model_dir)
    assert _fast_layer_types(policy.model), "PolicyModel's layers were not accelerated"
    after = mlx_lm.load(str(tiny_model_dir))[0]
    for model in (before, after):
        assert not _fast_layer_types(model)
        assert {qwen3.MLP, qwen3.Attention, nn.RMSNorm, nn.RoPE} <= _layer_types(model)
    assert qwen3.swiglu is activations.swiglu
    assert qwen3.scaled_dot_product_attention is base.scaled_dot_product_attention
    assert mx.array_equal(before(tokens), logits_before).item()  # bit for bit: same functions
    assert mx.array_equal(after(tokens), logits_before).item()


@pytest.mark.skipif(not ON_CPU, reason="the fast functions replace MLX's on the CPU only")
def test_accelerate_model_can_be_undone_and_is_idempotent(tiny_model_dir: Path) -> None:
    from mlx_lm.models import qwen3

    from models.policy_model import PolicyModel

    policy = PolicyModel.from_pretrained(tiny_model_dir, fast_math=False)
    plain = _layer_types(policy.model)
    assert not _fast_layer_types(policy.model)
    assert {qwen3.MLP, qwen3.Attention, nn.RMSNorm, nn.RoPE} <= plain
    assert fast_layers.accelerate_model(policy.model) is fast_math.fast_math_enabled()
    fast = _layer_types(policy.model)
    assert fast_layers.accelerate_model(policy.model) is fast_math.fast_math_enabled()
    assert _layer_types(policy.model) == fast  # a second call changes nothing
    assert fast_layers.accelerate_model(policy.model, enabled=False) is False
    assert _layer_types(policy.model) == plain


@pytest.mark.skipif(not ON_CPU, reason="the fast functions replace MLX's on the CPU only")
@pytest.mark.parametrize("trainer", ["ppo", "sft", "reward"])
@pytest.mark.parametrize("enabled", [True, False])
def test_config_fast_math_switches_every_model_of_a_run(
    tiny_model_dir: Path, tmp_path: Path, trainer: str, enabled: bool
) -> None:
    """``fast_math`` in the PPO / SFT / reward config decides for every model the trainer loads."""
    from config.ppo_config import PPOConfig
    from config.reward_config import RewardConfig
    from config.sft_config import SFTConfig
    from ppo_trainer.ppo_trainer import PPOTrainer
    from finetune.reward_trainer import RewardTrainer
    from finetune.sft_trainer import SFTTrainer

    common: dict[str, Any] = dict(
        model_name=str(tiny_model_dir), output_dir=str(tmp_path), fast_math=enabled
    )
    models: list[Any]
    if trainer == "ppo":  # no LoRA: a separate reference; the value model from the policy
        ppo = PPOTrainer(
            PPOConfig(**common, use_lora=False, progress_bar=False),
            reward_model=lambda prompts, completions: [0.0] * len(completions),
        )
        assert ppo.ref_model is not None and ppo.value_model is not None
        assert not ppo.ref_model.shares_policy_weights
        models = [ppo.policy.model, ppo.ref_model.model, ppo.value_model.model]
    elif trainer == "sft":
        models = [SFTTrainer(SFTConfig(**common, progress_bar=False)).model.model]
    else:
        models = [RewardTrainer(RewardConfig(**common, progress_bar=False)).reward_model.model]
    for model in models:
        assert bool(_fast_layer_types(model)) is (enabled and fast_math.fast_math_enabled())


# What base_setup.fast_math assumes of mlx-lm. An mlx-lm upgrade that changes any of it fails
# here, naming what changed, rather than running other math than the tests checked.
#: sha256 of the source of the mlx-lm functions whose results the fast layers reproduce.
MLX_LM_SOURCES = {
    "mlx_lm.models.activations.swiglu": (
        "f33dad1e9f94f039a4fed04bbf12716b35f037d63521aca73e41269413e84373"
    ),
    "mlx_lm.models.base.scaled_dot_product_attention": (
        "8deba4a8a8fb4e29f1e69ea81701da68f08f90656e1421a1e7a82332aadc41c1"
    ),
}


def test_mlx_lm_functions_the_fast_layers_replace_are_unchanged() -> None:
    """The fast ``swiglu`` and attention reproduce mlx-lm's ``activations.swiglu`` and
    ``base.scaled_dot_product_attention`` (the latter: ``mx.fast.scaled_dot_product_attention``
    unless the KV cache is quantised or there are sinks, where ours defers to it). A changed
    source means that assumption must be checked again."""
    import hashlib
    import importlib
    import inspect

    for name, expected in MLX_LM_SOURCES.items():
        module, _, attr = name.rpartition(".")
        source = inspect.getsource(getattr(importlib.import_module(module), attr))
        digest = hashlib.sha256(source.encode()).hexdigest()
        assert digest == expected, (
            f"mlx-lm's {name} changed (source sha256 {digest}, checked against {expected}). "
            "base_setup.fast_math reproduces it: read the new source, make the fast function "
            "(swiglu / _mlx_lm_attention) match it or defer to it, then update MLX_LM_SOURCES "
            f"in tests/test_backend.py. The new source:\n{source}"
        )


def test_mlx_lm_attention_signature_is_the_one_the_fast_layers_take() -> None:
    import inspect

    from mlx_lm.models import base

    original, ours = fast_layers.mlx_lm_replacements()["scaled_dot_product_attention"]
    assert original is base.scaled_dot_product_attention

    def parameters(fn: Any) -> list[tuple[str, Any, Any]]:
        return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]

    assert parameters(ours) == parameters(original), (
        "mlx-lm's scaled_dot_product_attention now takes "
        f"{inspect.signature(original)}; base_setup.fast_layers._mlx_lm_attention takes "
        f"{inspect.signature(ours)}: make them match"
    )


@pytest.mark.parametrize("mask_kind", ["causal", "bool", "additive", "none"])
def test_fast_attention_matches_mlx_lm_attention(mask_kind: str) -> None:
    """What mlx-lm's attention gives (no cache and a KV cache) is what the fast one gives."""
    from mlx_lm.models import base
    from mlx_lm.models.cache import KVCache

    rng = np.random.default_rng(11)
    b, h, hkv, length, d = 2, 4, 2, 32, 16  # above the fast attention's size threshold
    q, k, v = (
        mx.array(rng.normal(size=shape).astype(np.float32))
        for shape in ((b, h, length, d), (b, hkv, length, d), (b, hkv, length, d))
    )
    mask: mx.array | str | None = {
        "causal": "causal",
        "bool": base.create_causal_mask(length, 0),
        "additive": mx.array(rng.normal(size=(length, length)).astype(np.float32)),
        "none": None,
    }[mask_kind]
    _, ours = fast_layers.mlx_lm_replacements()["scaled_dot_product_attention"]
    for cache in (None, KVCache()):
        want = base.scaled_dot_product_attention(
            q, k, v, cache=cache, scale=0.25, mask=cast(Any, mask)
        )
        got = ours(q, k, v, cache=cache, scale=0.25, mask=mask)
        np.testing.assert_allclose(np.array(got), np.array(want), atol=2e-6)
    # A decoding step: the last query position against every key (the one-query path).
    last = mask if not isinstance(mask, mx.array) else mask[-1:]
    for cache in (None, KVCache()):
        want = base.scaled_dot_product_attention(
            q[:, :, -1:], k, v, cache=cache, scale=0.25, mask=cast(Any, last)
        )
        got = ours(q[:, :, -1:], k, v, cache=cache, scale=0.25, mask=last)
        np.testing.assert_allclose(np.array(got), np.array(want), atol=2e-6)


def test_fast_swiglu_matches_mlx_lm_swiglu() -> None:
    from mlx_lm.models import activations

    rng = np.random.default_rng(12)
    gate, up = (mx.array(rng.normal(0, 4, (8, 512)).astype(np.float32)) for _ in range(2))
    want = activations.swiglu(gate, up)
    got = fast_math.swiglu(gate, up)
    np.testing.assert_allclose(np.array(got), np.array(want), rtol=2e-6, atol=1e-6)


#: Small configurations of the architectures the fast layers are checked on (mlx-lm ModelArgs).
_ARCHITECTURES: dict[str, dict[str, Any]] = {
    **{
        arch: dict(
            model_type=arch,
            hidden_size=64,
            num_hidden_layers=2,
            intermediate_size=128,
            num_attention_heads=4,
            num_key_value_heads=2,
            rms_norm_eps=1e-6,
            vocab_size=97,
            rope_theta=10000.0,
            max_position_embeddings=256,
            tie_word_embeddings=True,
            head_dim=16,
        )
        for arch in ("llama", "qwen2", "qwen3", "phi3")
    },
    "gpt2": dict(
        model_type="gpt2",
        n_ctx=256,
        n_embd=64,
        n_head=4,
        n_layer=2,
        n_positions=256,
        layer_norm_epsilon=1e-5,
        vocab_size=97,
    ),
}
#: What each architecture's fast layers replace: {layer class: names of mlx-lm's functions}.
_REPLACED: dict[str, dict[str, tuple[str, ...]]] = {
    "llama": {"MLP": ("swiglu",), "Attention": ("scaled_dot_product_attention",)},
    "qwen2": {"MLP": ("swiglu",), "Attention": ("scaled_dot_product_attention",)},
    "qwen3": {"MLP": ("swiglu",), "Attention": ("scaled_dot_product_attention",)},
    "phi3": {"MLP": ("swiglu",), "Attention": ("scaled_dot_product_attention",)},
    "gpt2": {"Attention": ("scaled_dot_product_attention",)},
}


@pytest.mark.slow
@pytest.mark.skipif(not ON_CPU, reason="the fast functions replace MLX's on the CPU only")
@pytest.mark.parametrize("arch", sorted(_ARCHITECTURES))
def test_fast_layers_of_each_architecture_match_mlx_lm(
    arch: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Per architecture: the MLP / attention layers still call mlx-lm's ``swiglu`` /
    ``scaled_dot_product_attention`` by those names (so the fast layers apply), the fast paths
    run, and logits and gradients equal those of the same weights on mlx-lm's own layers."""
    import importlib

    from mlx.utils import tree_flatten

    module = importlib.import_module(f"mlx_lm.models.{arch}")
    args = module.ModelArgs.from_dict(_ARCHITECTURES[arch])
    plain = module.Model(args)
    fast = module.Model(args)
    fast.update(plain.parameters())
    assert fast_layers.accelerate_model(fast)
    replaced = {
        t.__bases__[0].__name__: t.fast_math_replaces
        for t in _fast_layer_types(fast)
        if hasattr(t, "fast_math_replaces")
    }
    assert replaced == _REPLACED[arch], (
        f"mlx-lm's {arch} layers now call other functions: the fast layers replace {replaced}, "
        f"expected {_REPLACED[arch]}; see base_setup.fast_layers.mlx_lm_replacements"
    )
    assert not _fast_layer_types(plain)

    calls: list[str] = []
    real_swiglu, real_attention = fast_math._swiglu_fast, fast_math.scaled_dot_product_attention

    def count_swiglu(gate: mx.array, x: mx.array) -> Any:
        calls.append("swiglu")
        return real_swiglu(gate, x)

    def count_attention(*arrays: mx.array, **kwargs: Any) -> mx.array:
        calls.append("attention")
        return real_attention(*arrays, **kwargs)

    monkeypatch.setattr(fast_math, "_swiglu_fast", count_swiglu)
    monkeypatch.setattr(fast_math, "scaled_dot_product_attention", count_attention)
    tokens = mx.array(np.random.default_rng(6).integers(0, 97, (2, 32)))  # fast-path sizes

    def loss(model: nn.Module) -> mx.array:
        return (model(tokens)[:, 3:] ** 2).mean()

    fast_value, fast_grads = nn.value_and_grad(fast, loss)(fast)
    value, grads = nn.value_and_grad(plain, loss)(plain)
    expected_calls = {"attention"} | ({"swiglu"} if "MLP" in _REPLACED[arch] else set())
    assert set(calls) == expected_calls
    np.testing.assert_allclose(np.array(fast(tokens)), np.array(plain(tokens)), atol=1e-4)
    np.testing.assert_allclose(fast_value.item(), value.item(), rtol=1e-5)
    fast_flat = dict(cast(list[tuple[str, mx.array]], tree_flatten(fast_grads)))
    for name, g in cast(list[tuple[str, mx.array]], tree_flatten(grads)):
        scale = float(mx.abs(g).max()) + 1e-12
        assert float(mx.abs(fast_flat[name] - g).max()) / scale < 1e-4, f"{arch}: {name}"


# ------------------------------------------------------------------ canaries of private names
# The private MLX / mlx-lm names the library still uses (none has a public equivalent), each
# with a canary that fails, naming the versions it was checked on, when a new release changes it.
CHECKED_ON = {"mlx": "0.32.4", "mlx-lm": "0.32.2"}


def _versions() -> str:
    import importlib.metadata as md

    now = {name: md.version(name) for name in CHECKED_ON}
    return f"checked on {CHECKED_ON}, installed {now}"


def test_canary_mlx_lm_get_classes() -> None:
    """models/backbone_loading.py (and fixtures/checkpoint_families.py, benchmarks/) build an
    architecture's classes from a config with mlx-lm's private ``mlx_lm.utils._get_classes``
    (its public ``load_model`` also reads the weights from disk): it must still map a config to
    ``(Model, ModelArgs)``, with mlx-lm's remapping of model types."""
    from mlx_lm.models import llama, qwen3
    from mlx_lm.utils import _get_classes

    assert _get_classes({"model_type": "qwen3"}) == (qwen3.Model, qwen3.ModelArgs), _versions()
    assert _get_classes({"model_type": "mistral"}) == (llama.Model, llama.ModelArgs), _versions()


def test_canary_mlx_dropout_keep_probability() -> None:
    """base_setup/grad_checkpoint.py tells whether a block draws random numbers from
    ``nn.Dropout``'s private ``_p_1`` (1 - p; MLX keeps no public p): it must still be that."""
    assert nn.Dropout(0.25)._p_1 == 0.75, _versions()
    assert nn.Dropout(0.0)._p_1 == 1.0, _versions()


# ------------------------------------------------------------------ gradient checkpointing
def _small_lora_qwen3(dropout: float) -> nn.Module:
    """A 3-block Qwen3 with LoRA adapters (non-zero B, so their dropout shows in the output)."""
    from mlx_lm.models import qwen3
    from mlx_lm.tuner.utils import linear_to_lora_layers

    args = qwen3.ModelArgs(
        model_type="qwen3",
        hidden_size=64,
        num_hidden_layers=3,
        intermediate_size=160,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        rms_norm_eps=1e-6,
        vocab_size=300,
        max_position_embeddings=256,
        rope_theta=10000.0,
        tie_word_embeddings=True,
    )
    mx.random.seed(3)
    model = qwen3.Model(args)
    model.freeze()
    linear_to_lora_layers(model, 3, {"rank": 4, "scale": 2.0, "dropout": dropout})
    for name, leaf in cast(list[tuple[str, mx.array]], tree_flatten(model.trainable_parameters())):
        if name.endswith("lora_b"):
            model.update(tree_unflatten([(name, mx.random.normal(leaf.shape) * 0.1)]))
    mx.eval(model.parameters())
    return model


def _loss_and_grads(model: nn.Module, ids: mx.array, seed: int) -> tuple[float, dict[str, Any]]:
    def loss(m: nn.Module) -> mx.array:
        return nn.losses.cross_entropy(m(ids[:, :-1]), ids[:, 1:]).mean()

    mx.random.seed(seed)
    value, grads = nn.value_and_grad(model, loss)(model)
    mx.eval(value, grads)
    return value.item(), dict(tree_flatten(grads))


@pytest.mark.slow
def test_checkpointed_blocks_give_the_same_loss_and_gradients_in_less_memory() -> None:
    ids = mx.array(np.random.default_rng(0).integers(0, 300, (4, 48)))
    plain = _small_lora_qwen3(0.0)
    want_loss, want = _loss_and_grads(plain, ids, 0)
    mx.synchronize()
    mx.reset_peak_memory()
    _loss_and_grads(plain, ids, 0)
    plain_peak = mx.get_peak_memory()

    model = _small_lora_qwen3(0.0)
    assert checkpoint_blocks(model) == 3 and all(is_checkpointed(b) for b in model.layers)
    assert checkpoint_blocks(model) == 0  # already checkpointed
    got_loss, got = _loss_and_grads(model, ids, 0)
    mx.synchronize()
    mx.reset_peak_memory()
    _loss_and_grads(model, ids, 0)
    assert mx.get_peak_memory() < plain_peak  # only each block's input is kept
    assert got_loss == want_loss and got.keys() == want.keys() and len(got) == 3 * 7 * 2
    for key, grad in want.items():  # the recomputation is the same computation
        np.testing.assert_array_equal(np.array(got[key]), np.array(grad), err_msg=key)

    assert checkpoint_blocks(model, enabled=False) == 3
    assert not any(is_checkpointed(b) for b in model.layers)
    assert type(model.layers[0]).__call__ is type(plain.layers[0]).__call__


def test_checkpointed_dropout_recomputes_with_the_forward_masks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Without recomputation (mx.checkpoint as the identity) the gradient is the one of the
    # masks the forward pass drew; a recomputation with other masks would give another.
    ids = mx.array(np.random.default_rng(1).integers(0, 300, (4, 32)))
    model = _small_lora_qwen3(0.3)
    model.train()
    checkpoint_blocks(model)
    got_loss, got = _loss_and_grads(model, ids, 7)
    again_loss, _ = _loss_and_grads(model, ids, 8)
    assert again_loss != got_loss  # the dropout acts
    monkeypatch.setattr(mx, "checkpoint", lambda fn: fn)
    want_loss, want = _loss_and_grads(model, ids, 7)
    assert got_loss == want_loss
    for key, grad in want.items():
        np.testing.assert_allclose(np.array(got[key]), np.array(grad), rtol=1e-5, atol=1e-7)


def test_checkpointed_blocks_decode_with_a_cache_as_before() -> None:
    from mlx_lm.models.cache import make_prompt_cache

    ids = mx.array(np.random.default_rng(2).integers(0, 300, (2, 12)))
    plain, model = _small_lora_qwen3(0.0), _small_lora_qwen3(0.0)
    checkpoint_blocks(model)
    outputs = []
    for m in (plain, model):
        cache = make_prompt_cache(m)
        m(ids[:, :-1], cache=cache)
        outputs.append(np.array(m(ids[:, -1:], cache=cache)))
    np.testing.assert_array_equal(outputs[0], outputs[1])
    with pytest.raises(ValueError, match="no transformer blocks"):
        checkpoint_blocks(nn.Linear(2, 2))
