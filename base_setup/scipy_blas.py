"""MLX's BLAS and LAPACK calls routed to scipy-openblas32: OpenBLAS built for every x86-64 CPU.

The ``cmeel-openblas`` wheel is built for one CPU family (0.3.29: Zen, AVX2 kernels; 0.3.31:
AVX-512 only). On a CPU with AVX-512 (an Intel Xeon) the Zen build leaves half of each vector
register unused, while PyTorch's matmuls (oneDNN, MKL) use all of it. ``scipy-openblas32``, the
OpenBLAS wheel NumPy and SciPy build against, is built with ``DYNAMIC_ARCH``: it picks the kernels
of the CPU it runs on when it loads, and needs no libgfortran. Its symbols carry a ``scipy_``
prefix, so MLX's references (``cblas_sgemm``, ``sgetrf_``, ...: :data:`MLX_SYMBOLS`) cannot bind
to them. A small library of trampolines does: for each of MLX's symbols one ``jmp`` through a
table that :func:`route_to_scipy_openblas` fills with the addresses of scipy-openblas32's
functions. The trampolines are assembled once with the C compiler (the one ``mx.compile`` uses on
the CPU) into the user's cache (:func:`cache_dir`). They have no dependency, and scipy-openblas32
stays out of the global scope (loaded ``RTLD_LOCAL``), so none of its other symbols can meet the
reference LAPACK MLX's wheel links.

``base_setup.backend.setup_blas`` uses this path first on Linux x86-64 and falls back to
``cmeel-openblas`` when it cannot (no compiler, wheel missing); ``PPO_MLX_BLAS=cmeel`` chooses
the fallback.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

#: The BLAS and LAPACK functions libmlx.so (mlx 0.32) leaves undefined: its matmuls and the
#: LAPACK routines behind ``mx.linalg``. Each gets a trampoline.
MLX_SYMBOLS: tuple[str, ...] = (
    "cblas_sgemm",
    "cblas_dgemm",
    "cblas_cgemm",
    "sgeev_",
    "dgeev_",
    "cgeev_",
    "sgesdd_",
    "dgesdd_",
    "cgesdd_",
    "ssyevd_",
    "dsyevd_",
    "cheevd_",
    "sgeqrf_",
    "dgeqrf_",
    "sorgqr_",
    "dorgqr_",
    "sgetrf_",
    "dgetrf_",
    "sgetri_",
    "dgetri_",
    "spotrf_",
    "dpotrf_",
    "strtri_",
    "dtrtri_",
)
#: The trampolines' table of target addresses (exported, filled through ctypes).
TABLE_SYMBOL = "ppo_mlx_blas_table"
#: The prefix of scipy-openblas32's symbols.
PREFIX = "scipy_"


def trampolines_source(symbols: tuple[str, ...]) -> str:
    """x86-64 assembly (GNU as): each of ``symbols`` a global function that jumps to the address
    in its slot of :data:`TABLE_SYMBOL` (the arguments pass through untouched, whatever the
    signature)."""
    lines = ["    .text"]
    for i, name in enumerate(symbols):
        lines += [
            f"    .globl {name}",
            f"    .type {name}, @function",
            f"{name}:",
            f"    jmp *.Ltable+{8 * i}(%rip)",
            f"    .size {name}, .-{name}",
        ]
    lines += [
        "    .data",
        "    .align 8",
        f"    .globl {TABLE_SYMBOL}",
        f"    .type {TABLE_SYMBOL}, @object",
        f"{TABLE_SYMBOL}:",
        ".Ltable:",
        f"    .zero {8 * len(symbols)}",
        f"    .size {TABLE_SYMBOL}, {8 * len(symbols)}",
        '    .section .note.GNU-stack,"",@progbits',
    ]
    return "\n".join(lines) + "\n"


def cache_dir() -> Path:
    """Where the trampolines are kept: ``$XDG_CACHE_HOME/ppo_mlx`` (default ``~/.cache``)."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "ppo_mlx"


def c_compiler() -> str | None:
    """The C compiler that assembles the trampolines: ``$CC``, else ``cc``, else ``gcc`` (None:
    none found)."""
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def build_trampolines(symbols: tuple[str, ...], directory: Path) -> Path:
    """The shared library of :func:`trampolines_source`, assembled once per source into
    ``directory`` (a temporary file renamed into place, so that processes building it at the
    same time never load half a file).

    Raises:
        OSError: no C compiler (``$CC``, ``cc`` or ``gcc``), or it could not build the library.
    """
    source = trampolines_source(symbols)
    digest = hashlib.sha256(source.encode()).hexdigest()[:16]
    target = directory / f"mlx_blas_trampolines_{digest}.so"
    if target.is_file():
        return target
    compiler = c_compiler()
    if compiler is None:
        raise OSError("no C compiler ($CC, cc or gcc) to assemble the BLAS trampolines")
    directory.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=directory) as tmp:
        asm = Path(tmp) / "trampolines.S"
        asm.write_text(source, encoding="ascii")
        built = Path(tmp) / target.name
        done = subprocess.run(
            [compiler, "-shared", "-nostdlib", "-o", str(built), str(asm)],
            capture_output=True,
            text=True,
            check=False,
        )
        if done.returncode != 0:
            raise OSError(
                f"{compiler} could not build the BLAS trampolines: {done.stderr.strip()[-400:]}"
            )
        os.replace(built, target)
    return target


class ScipyOpenBLAS:
    """scipy-openblas32 as the rest of the backend calls OpenBLAS: its thread count and build
    under OpenBLAS's plain names."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self.lib = lib
        lib.scipy_openblas_get_corename.restype = ctypes.c_char_p
        lib.scipy_openblas_get_config.restype = ctypes.c_char_p

    def openblas_get_num_threads(self) -> int:
        """OpenBLAS's thread count now."""
        return int(self.lib.scipy_openblas_get_num_threads())

    def openblas_set_num_threads(self, threads: int) -> None:
        """Set OpenBLAS's thread count (never while a matmul runs)."""
        self.lib.scipy_openblas_set_num_threads(int(threads))

    def corename(self) -> str:
        """The CPU family whose kernels it chose at load (``HASWELL``, ``SKYLAKEX``, ...)."""
        return (self.lib.scipy_openblas_get_corename() or b"").decode()

    def config(self) -> str:
        """Its build line (version, options)."""
        return (self.lib.scipy_openblas_get_config() or b"").decode()


def route_to_scipy_openblas(
    lib_path: Path, directory: Path | None = None
) -> tuple[ScipyOpenBLAS, Path]:
    """Load scipy-openblas32 from ``lib_path`` (``RTLD_LOCAL``) and the trampolines (built into
    ``directory``, default :func:`cache_dir` ``/ "blas"``) into the global scope, with their table
    filled: MLX's BLAS and LAPACK references, once ``mlx.core`` is imported, bind to the
    trampolines and run scipy-openblas32's functions. Must run before ``mlx.core`` is imported.

    Returns:
        The loaded library (thread control, build) and the trampolines' path.

    Raises:
        OSError: the library lacks one of the functions, or the trampolines could not be built.
    """
    lib = ctypes.CDLL(str(lib_path), os.RTLD_LOCAL)
    missing = [name for name in MLX_SYMBOLS if not hasattr(lib, PREFIX + name)]
    if missing:
        raise OSError(f"{lib_path} lacks {', '.join(PREFIX + m for m in missing)}")
    path = build_trampolines(MLX_SYMBOLS, directory or cache_dir() / "blas")
    trampolines = ctypes.CDLL(str(path), os.RTLD_GLOBAL)
    table = (ctypes.c_void_p * len(MLX_SYMBOLS)).in_dll(trampolines, TABLE_SYMBOL)
    for i, name in enumerate(MLX_SYMBOLS):
        table[i] = ctypes.cast(getattr(lib, PREFIX + name), ctypes.c_void_p).value
    return ScipyOpenBLAS(lib), path
