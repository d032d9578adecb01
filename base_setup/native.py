"""Native CPU kernels for the element-wise work of a transformer layer, split over the run's
threads: SwiGLU (forward and gradient), the attention's softmax (its exponentials with their row
maxima, and its score gradient), a large RMSNorm (forward and gradient), RoPE (forward and
gradient, one graph node where the composed rotation takes about fifteen), the LM head's
softmax by vocabulary blocks, a decoding step's draw, and a decoding step's matmuls (the
few-row matmul: a GEMM's packing of the weights costs as much as its arithmetic at 16 rows).

Why: MLX's CPU backend runs every element-wise op on one thread (its stream's), and on x86 its
loops are scalar. The fast functions of :mod:`base_setup.fast_math` made the arithmetic cheap
(``exp`` rebuilt from operations ``mx.compile`` fuses into loops gcc vectorizes), but each is
still three or four passes over memory on one core while the other cores wait, and with the
matmuls on every core that single-threaded work is a large share of a forward pass
(docs/performance.md). These kernels do the same arithmetic in one pass, vectorised for the
machine (``-march=native``), over the run's threads.

What: ``native_kernels.cpp`` (beside this file) defines MLX custom primitives (``eval_cpu``
only) and their Python bindings. Each computes exactly the float32 operations of the fast
function it stands for, in the same order, built with ``-ffp-contract=off``: the same bits, which
the tests check. :mod:`base_setup.fast_math` calls them where its fast functions would run, for
float32 arrays, inside its custom functions whose gradients are written out (RMSNorm's primitive
has its own: MLX's formula, with the weight's sum over rows in fixed blocks of rows, so the same
bits at any thread count, though not MLX's bits; RoPE's is the rotation by the opposite angle,
with MLX's own sine and cosine: the fast function's bits); ``token_attribution.head_logprobs``
and the generator's sampler call them through :func:`base_setup.fast_math.native_kernels`.
The few-row matmul stands for no fast function: its sums are fma chains over the inner axis in
order, the same bits on AVX-512 and AVX2 and at any thread count, not OpenBLAS's (a float32
matmul's rounding); :mod:`base_setup.fast_layers` gives it to large models' linear layers
(:func:`base_setup.fast_math.few_row_matmul`).

How it is built: with the system ``g++`` against MLX's headers and ``libmlx.so`` (in the ``mlx``
wheel) and ``nanobind``'s sources (a requirement), once per machine: the first process that needs
the kernels builds them (others wait on a file lock) into
``$XDG_CACHE_HOME/ppo_mlx/native/<key>/`` (default ``~/.cache``), where ``<key>`` hashes the
source, MLX, nanobind, the compiler, Python's ABI and the CPU. The module joins MLX's nanobind
domain (``mlx``), so it takes and returns ``mx.array``; if MLX's bindings were built with another
nanobind ABI the load check fails and the kernels are off.

Where not: off Linux (macOS runs MLX on the GPU), without ``g++``, Python's headers or
``nanobind``, when the build fails (a ``<key>.failed`` note beside the folder keeps later
processes from trying again; delete it to retry), with ``PPO_MLX_NATIVE=0``, and wherever the fast
math is off. Each of those logs why once and leaves the fast functions as they were.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.machinery
import importlib.util
import logging
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path
from types import ModuleType
from typing import Any

from base_setup import jit_header
from base_setup.plain import env_mode
from base_setup.scipy_blas import cache_dir

logger = logging.getLogger("ppo_mlx")

ENV = "PPO_MLX_NATIVE"
SOURCE = Path(__file__).with_name("native_kernels.cpp")
#: The extension's module name (``NB_MODULE`` in the source).
MODULE = "_ppo_native"
#: The nanobind domain of MLX's Python bindings: an extension shares types only within one.
NB_DOMAIN = "mlx"
#: Flags besides the paths; ``-ffp-contract=off`` keeps the arithmetic MLX's kernels do.
FLAGS = (
    "-std=c++20",
    "-O3",
    "-march=native",
    "-ffp-contract=off",
    "-fPIC",
    "-shared",
    "-fvisibility=hidden",
    "-DNDEBUG",
    f"-DNB_DOMAIN={NB_DOMAIN}",
)

#: The loaded module (or None: off, with the reason logged), once per process.
_STATE: dict[str, Any] = {}


def native_mode() -> str:
    """``PPO_MLX_NATIVE``: "on" (the default; also "1") or "off" (also "0")."""
    return env_mode(ENV, {"on": "on", "1": "on", "off": "off", "0": "off"}, "1 (the default) or 0")


def kernels() -> ModuleType | None:
    """The native kernels' module, built and loaded on first use; None where they are off
    (module docstring), with the reason logged once per process.

    ``ValueError`` for a ``PPO_MLX_NATIVE`` other than 1, on, 0 or off.
    """
    if native_mode() == "off":
        return None
    if "module" not in _STATE:
        module, why = _load()
        if module is None:  # off Linux nothing is missing: the fast functions are the plan there
            level = logging.WARNING if sys.platform.startswith("linux") else logging.INFO
            logger.log(level, "native CPU kernels are off: %s", why)
        _STATE["module"] = module
    return _STATE["module"]


def set_threads(threads: int) -> None:
    """The threads the kernels split their work over: the run's BLAS thread count
    (:mod:`base_setup.backend` calls this wherever it sets OpenBLAS's, and when it loads it).
    Kept for a later load; builds nothing. Without OpenBLAS the kernels use every core this
    process may run on."""
    _STATE["threads"] = max(1, int(threads))
    module = _STATE.get("module")
    if module is not None:
        module.set_threads(_STATE["threads"])


def process_cpus() -> int:
    """The cores this process may run on (its CPU affinity where the platform has one)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0)) or 1
    return os.cpu_count() or 1


def build_inputs() -> dict[str, Path] | str:
    """What a build needs (``g++``, MLX's headers and library, nanobind's sources, Python's
    headers) by name, or why it cannot be built here."""
    if not sys.platform.startswith("linux"):
        return "they are built on Linux only"
    compiler = shutil.which("g++")
    if compiler is None:
        return "no g++ on PATH (install a C++ compiler, e.g. apt-get install g++)"
    mlx_root = jit_header.mlx_root()
    if mlx_root is None:
        return "mlx is not installed (as a wheel with lib/libmlx.so)"
    try:
        import nanobind
    except ImportError:
        return "nanobind is not installed (pip install -r requirements.txt)"
    nb_root = Path(nanobind.__file__).parent
    python_include = Path(sysconfig.get_paths()["include"])
    paths = {
        "compiler": Path(compiler).resolve(),
        "mlx_include": mlx_root / "include",
        "libmlx": mlx_root / "lib" / "libmlx.so",
        "nb_include": Path(nanobind.include_dir()),
        "nb_source": Path(nanobind.source_dir()) / "nb_combined.cpp",
        "robin_map": nb_root / "ext" / "robin_map" / "include",
        "python_include": python_include,
    }
    if not (python_include / "Python.h").is_file():
        return f"Python's headers are missing ({python_include}; e.g. apt-get install python3-dev)"
    missing = [str(path) for path in paths.values() if not path.exists()]
    if missing:
        return "missing: " + ", ".join(missing)
    return paths


def build_key(paths: dict[str, Path]) -> str:
    """What the built module depends on, hashed: the source, MLX's library and headers, nanobind,
    the compiler, Python's ABI, the flags and the CPU (``-march=native``)."""
    digest = hashlib.sha256(SOURCE.read_bytes())
    for name in ("compiler", "libmlx", "mlx_include", "nb_source", "python_include"):
        st = paths[name].stat()
        digest.update(f"{paths[name]}:{st.st_size}:{st.st_mtime_ns}\n".encode())
    digest.update(" ".join(FLAGS).encode())
    digest.update(str(sysconfig.get_config_var("EXT_SUFFIX")).encode())
    digest.update(_cpu_identity().encode())
    return digest.hexdigest()[:16]


def _cpu_identity() -> str:
    """The CPU's model and feature flags (the first processor of ``/proc/cpuinfo``)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""
    first = text.split("\n\n", 1)[0]
    return "\n".join(
        line for line in first.splitlines() if line.startswith(("model name", "flags"))
    )


def module_path(directory: Path) -> Path:
    """The built module's file in ``directory``."""
    return directory / f"{MODULE}{sysconfig.get_config_var('EXT_SUFFIX')}"


def build(paths: dict[str, Path], directory: Path) -> Path:
    """Compile the module into ``directory`` (written under a temporary name, then renamed, so a
    reader never sees half a file); returns its path. ``OSError`` with g++'s message if the
    compiler fails."""
    directory.mkdir(parents=True, exist_ok=True)
    target = module_path(directory)
    partial = target.with_name(f".{target.name}.{os.getpid()}")
    lib = paths["libmlx"].parent
    command = [
        str(paths["compiler"]),
        *FLAGS,
        str(SOURCE),
        str(paths["nb_source"]),
        *("-I", str(paths["nb_include"]), "-I", str(paths["robin_map"])),
        *("-I", str(paths["mlx_include"]), "-I", str(paths["python_include"])),
        *("-L", str(lib), "-lmlx", f"-Wl,-rpath,{lib}"),
        *("-o", str(partial)),
    ]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        partial.unlink(missing_ok=True)
        raise OSError(f"g++ failed: {done.stderr.strip()[-600:]}")
    os.replace(partial, target)
    return target


def _load() -> tuple[ModuleType | None, str]:
    """Build (once per machine) and load the module; ``(None, why)`` where that cannot be done."""
    paths = build_inputs()
    if isinstance(paths, str):
        return None, paths
    root = cache_dir() / "native"
    key = build_key(paths)
    directory, failed = root / key, root / f"{key}.failed"
    try:
        root.mkdir(parents=True, exist_ok=True)
        with open(root / f"{key}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # another process building it: wait for it
            if not module_path(directory).is_file():
                if failed.is_file():
                    return None, f"their build failed before (see {failed}; delete it to retry)"
                logger.info("building the native CPU kernels (once per machine)")
                try:
                    build(paths, directory)
                except OSError as err:
                    failed.write_text(str(err))
                    return None, f"the build failed: {err} (noted in {failed})"
    except OSError as err:
        return None, f"cannot use {root}: {err}"
    return _import(module_path(directory))


def _import(path: Path) -> tuple[ModuleType | None, str]:
    """Load the built module and check that it takes MLX's arrays and computes SwiGLU."""
    import mlx.core as mx  # the module links libmlx and joins mlx.core's nanobind domain
    import numpy as np

    loader = importlib.machinery.ExtensionFileLoader(MODULE, str(path))
    spec = importlib.util.spec_from_file_location(MODULE, path, loader=loader)
    if spec is None:
        return None, f"cannot load {path}"
    module = importlib.util.module_from_spec(spec)
    try:
        loader.exec_module(module)
    except ImportError as err:
        return None, f"cannot load {path}: {err}"
    gate = np.linspace(-30.0, 30.0, 97, dtype=np.float32)
    up = np.linspace(2.0, -1.0, 97, dtype=np.float32)
    try:
        got = np.array(module.swiglu(mx.array(gate), mx.array(up), stream=mx.cpu))
    except TypeError as err:
        return None, f"MLX's Python bindings use another nanobind ABI than this nanobind ({err})"
    g64 = gate.astype(np.float64)
    want = g64 / (1.0 + np.exp(-g64)) * up
    if not np.allclose(got, want, rtol=1e-5, atol=1e-6):
        raise RuntimeError(f"the native SwiGLU is wrong on this machine; set {ENV}=0")
    module.set_threads(_STATE.get("threads") or process_cpus())
    return module, ""
