"""A precompiled header for MLX's CPU kernel compiler: each fused kernel built in about a quarter
of the time.

On the CPU, MLX builds every fused element-wise kernel of an ``mx.compile``'d function (the
compiled training gradient, this project's fast math, mlx-lm's activations) into a shared library
with ``g++`` the first time it sees it, and keeps it in ``<temp dir>/mlx/<version>/cpu``. Each
kernel's source starts with ``#include "mlx/backend/cpu/compiled_preamble.h"``: about 69,000
lines of MLX's headers, whose parsing is most of each build. A fresh machine's first compiled
step on a real model builds dozens of kernels before it does any work, and again after every
reboot that empties ``/tmp`` (docs/performance.md, "The compiled training gradient", has the
figures).

GCC looks for a precompiled header, ``<header>.gch``, in each directory it searches for an
include, the including file's own directory first. :func:`prepare_jit_header` builds one there
(``<temp dir>/mlx/<version>/cpu/mlx/backend/cpu/compiled_preamble.h.gch``) with the flags of
MLX's own compile command, read from ``libmlx.so``; g++ then loads it instead of parsing the
headers.

GCC does not check every flag a precompiled header was built with: one built at another ``-O``
level was loaded, and g++ crashed. So the header is used only where MLX's command has exactly the
known shape (:func:`compile_flags`), is built with those flags, and is published (renamed into
place) only after MLX's own command, word for word, has built a probe kernel with it.

It is built once per MLX build, header set and compiler (a stamp beside it records which), in a
detached background process, so that no program waits for it: kernels built before it is ready
parse the headers as before. Linux with GCC only (macOS's ``g++`` is clang, and MLX uses the GPU
there). ``PPO_MLX_JIT_HEADER=0`` turns it off.
"""

from __future__ import annotations

import importlib.util
import logging
import mmap
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

from base_setup.plain import env_mode

logger = logging.getLogger("ppo_mlx")

#: The header every kernel source of MLX's CPU compiler includes first.
PREAMBLE = "mlx/backend/cpu/compiled_preamble.h"
#: A build lock older than this (seconds) was left by a killed build and is taken over.
STALE_LOCK_S = 300.0
#: MLX's kernel build command (mlx 0.32: ``g++ -std=c++17 -O3 -Wall -fPIC -shared {} "{}" -o
#: "{}" 2>&1``, the first placeholder its ``-I "<include dir>"``): g++, flags and nothing else
#: before the placeholders; after them only the source, the output and the redirection.
_COMMAND = re.compile(r'(g\+\+(?: +-[^\s{}"\'$`\\;&|<>]+)+) +\{\} +"\{\}" +-o +"\{\}"( +2>&1)?')
#: A kernel as MLX writes them: the preamble, then a C function using its element-wise ops.
_PROBE = (
    f'#include "{PREAMBLE}"\n'
    "using namespace mlx::core;\nusing namespace mlx::core::detail;\n"
    'extern "C" void ppo_mlx_probe(float* a, size_t n) {\n'
    "  for (size_t i = 0; i < n; ++i) a[i] = Maximum()(Multiply()(a[i], 2.5f), 0.0f);\n}\n"
)


def temp_directory() -> Path:
    """The directory C++'s ``std::filesystem::temp_directory_path()`` returns on POSIX (the first
    of ``$TMPDIR``, ``$TMP``, ``$TEMP``, ``$TEMPDIR`` that is set, else ``/tmp``): where MLX keeps
    its compiled kernels."""
    for name in ("TMPDIR", "TMP", "TEMP", "TEMPDIR"):
        value = os.environ.get(name)
        if value:
            return Path(value)
    return Path("/tmp")


def compile_flags(command_format: str) -> list[str] | None:
    """g++ and the flags of MLX's kernel build command (its format string in ``libmlx.so``), for
    building the header with; None unless the command has exactly the shape of :data:`_COMMAND`
    (another MLX, another compiler, a flag after the file: no header then)."""
    match = _COMMAND.fullmatch(command_format)
    if match is None:
        return None
    return [word for word in match.group(1).split() if word != "-shared"]


def mlx_command_format(libmlx: Path) -> str | None:
    """MLX's kernel build command format, read from its library (None if it holds none)."""
    with open(libmlx, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
        start = data.find(b"g++ -std=")
        if start < 0:
            return None
        end = data.find(b"\0", start)
        return data[start:end].decode("utf-8", "replace")


def mlx_root() -> Path | None:
    """The installed ``mlx`` package's folder (the one holding ``lib/libmlx.so``), found without
    importing ``mlx.core``; None where MLX is not installed as a wheel with that library.

    ``mlx`` is a namespace package, so any folder named ``mlx`` on ``sys.path`` is one of its
    locations, e.g. MLX's own kernel cache ``/tmp/mlx`` for a script run from ``/tmp``: the first
    location is not necessarily the wheel's."""
    spec = importlib.util.find_spec("mlx")
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        if (Path(location) / "lib" / "libmlx.so").is_file():
            return Path(location)
    return None


def _mlx_paths() -> tuple[Path, Path, str] | None:
    """MLX's ``include`` directory (with the preamble), ``libmlx.so`` and version, found without
    importing ``mlx.core`` (None if any is missing)."""
    root = mlx_root()
    if root is None:
        return None
    include, libmlx = root / "include", root / "lib" / "libmlx.so"
    if not (include / PREAMBLE).is_file() or not libmlx.is_file():
        return None
    # The wheel's version (its dist-info folder beside the package: no importlib.metadata, which
    # costs every program tens of milliseconds to import) is the one MLX names its folder by.
    dist_infos = sorted(root.parent.glob("mlx-*.dist-info"))
    if len(dist_infos) != 1:
        return None
    version = dist_infos[0].name[len("mlx-") : -len(".dist-info")]
    return include, libmlx, version


def _stamp(include: Path, libmlx: Path, compiler: Path) -> str:
    """What the header was built from: the library, the headers' directory and the compiler, by
    path, size and modification time (a new MLX or g++ changes one of them)."""
    parts = []
    for path in (libmlx, include / PREAMBLE, include / "mlx", compiler):
        st = path.stat()
        parts.append(f"{path}:{st.st_size}:{st.st_mtime_ns}")
    return "\n".join(parts) + "\n"


def _beside(target: Path, suffix: str) -> Path:
    """The header's stamp, failure note or build lock: ``<target><suffix>``."""
    return target.with_name(target.name + suffix)


def header_path(version: str) -> Path:
    """Where g++ finds the precompiled header for MLX ``version``'s kernel sources."""
    return temp_directory() / "mlx" / version / "cpu" / (PREAMBLE + ".gch")


def prepare_jit_header(wait: bool = False) -> Path | None:
    """Start building the precompiled header for MLX's CPU kernels if it is missing or stale
    (module docstring); returns its path, or None where it does not apply (not Linux, no GCC,
    MLX without its headers or with another command, ``PPO_MLX_JIT_HEADER=0``) or another process
    is building it.

    ``ValueError`` for a ``PPO_MLX_JIT_HEADER`` other than 1, on, 0 or off.

    ``wait=True`` builds it in this process and raises ``OSError`` if that fails (tests, and a
    machine image prepared ahead). By default the build runs detached in the background, and
    its failure raises nothing: it only costs the speed-up.
    """
    aliases = {"1": "on", "on": "on", "0": "off", "off": "off"}
    if env_mode("PPO_MLX_JIT_HEADER", aliases, "1 (the default) or 0") == "off":
        return None
    if not sys.platform.startswith("linux"):
        return None
    found = _mlx_paths()
    compiler = shutil.which("g++")
    if found is None or compiler is None:
        return None
    include, libmlx, version = found
    target = header_path(version)
    stamp_file = _beside(target, ".stamp")
    failed_file = _beside(target, ".failed")
    lock = _beside(target, ".lock")
    try:
        stamp = _stamp(include, libmlx, Path(compiler).resolve())
        if target.is_file() and stamp_file.is_file() and stamp_file.read_text() == stamp:
            return target
        if not wait and failed_file.is_file() and failed_file.read_text() == stamp:
            return None  # it failed with this MLX and g++: not again at every start
        command_format = mlx_command_format(libmlx)
        if command_format is None or compile_flags(command_format) is None:
            return None
        target.parent.mkdir(parents=True, exist_ok=True)
        if not _take_lock(lock):
            return None
    except OSError as err:
        if wait:
            raise
        logger.debug("no precompiled header for MLX's kernels: %s", err)
        return None
    args = [str(include), command_format, str(target), stamp]
    if wait:
        build_header(*args)
        return target
    # A shell that starts the build in the background and exits at once: the build outlives
    # this process and leaves no child behind.
    code = "import sys; from base_setup.jit_header import build_header; build_header(*sys.argv[1:])"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    build = shlex.join([sys.executable, "-c", code, *args])
    try:
        subprocess.run(
            ["sh", "-c", f"{build} </dev/null >/dev/null 2>&1 &"],
            env=env,
            check=True,
            start_new_session=True,
        )
    except (OSError, subprocess.CalledProcessError) as err:
        lock.unlink(missing_ok=True)
        logger.debug("no precompiled header for MLX's kernels: %s", err)
        return None
    return target


def build_header(include: str, command_format: str, target: str, stamp: str) -> None:
    """Build the header for MLX's ``command_format`` in a folder of its own, check that the
    command, word for word, builds a probe kernel with it, then rename it to ``target`` and write
    ``stamp`` beside it. Releases the build lock (``<target>.lock``) whatever happens; a failure
    leaves ``<target>.failed`` holding ``stamp``, so that programs do not try again until MLX or
    g++ changes (``prepare_jit_header(wait=True)`` still does).

    Raises:
        OSError: g++ failed, or did not load the header for the probe.
    """
    final = Path(target)
    lock = _beside(final, ".lock")
    work = final.parents[3] / f"jit-header-build-{os.getpid()}"
    try:
        flags = compile_flags(command_format)
        if flags is None:
            raise OSError(f"not a kernel build command this module knows: {command_format!r}")
        header = work / (PREAMBLE + ".gch")
        header.parent.mkdir(parents=True, exist_ok=True)
        source = Path(include) / PREAMBLE
        _run([*flags, "-x", "c++-header", "-I", include, "-o", str(header), str(source)])
        probe = work / "probe.cpp"
        probe.write_text(_PROBE)
        command = command_format.format(
            f'-I "{include}"', str(probe), str(work / "libprobe.so")
        ).replace("g++", "g++ -H", 1)
        output = _run(["sh", "-c", command])
        if f"! {header}" not in output:
            raise OSError(f"g++ built the probe without loading {header}")
        os.replace(header, final)
        _beside(final, ".stamp").write_text(stamp)
        _beside(final, ".failed").unlink(missing_ok=True)
    except OSError:
        _beside(final, ".failed").write_text(stamp)
        raise
    finally:
        shutil.rmtree(work, ignore_errors=True)
        lock.unlink(missing_ok=True)


def _run(command: list[str]) -> str:
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise OSError(f"{shlex.join(command)[:200]} failed: {done.stderr.strip()[-400:]}")
    return done.stdout + done.stderr


def _take_lock(lock: Path) -> bool:
    """Whether this process may build: it created ``lock``, or took over a stale one."""
    for _ in range(2):
        try:
            fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            try:
                if time.time() - lock.stat().st_mtime < STALE_LOCK_S:
                    return False  # another process is building it
                lock.unlink()
            except FileNotFoundError:
                pass  # it finished meanwhile: try again
            continue
        os.write(fd, str(os.getpid()).encode())
        os.close(fd)
        return True
    return False
