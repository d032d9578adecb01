"""MLX backend set-up: a fast BLAS on Linux, the device, and one seed for every RNG.

The Linux ``mlx[cpu]`` wheel links the slow netlib reference BLAS. Loading OpenBLAS from the
``cmeel-openblas`` wheel into the global symbol scope *before* ``mlx.core`` is first imported makes
MLX's ``cblas_*`` calls resolve to OpenBLAS instead (docs/performance.md). This module does
that without importing mlx, so :func:`setup_blas` must run before anything imports ``mlx.core``:
every entry point calls it first (``main.py``, ``tests/conftest.py``, the examples and
benchmarks run as scripts), and a script of your own should too::

    from base_setup import setup_blas

    setup_blas()  # before any import of mlx or of this project's packages

Where it was missed, MLX keeps the reference BLAS; the first model this project builds then logs
a warning saying so (:func:`blas_info` runs then). The environment settings are described in
``docs/environment.md``.

Two details of the wheel are handled here rather than left to the user:

* ``libopenblas.so.0`` needs ``libgfortran.so.5``, which a fresh Linux machine often lacks. NumPy's
  wheel ships one (renamed by auditwheel); we load it under the name OpenBLAS asks for.
* The wheel is built for one CPU family (its ``openblas_get_corename()``), not for all of them. We
  check that the CPU has the instructions that family needs before putting OpenBLAS in the global
  scope, so an unsupported CPU gets the slow-but-correct reference BLAS, not ``Illegal instruction``.
"""

from __future__ import annotations

import ctypes
import glob
import logging
import math
import os
import platform
import random
import sys
import sysconfig
import time
from contextlib import nullcontext, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Sequence, cast

from base_setup.jit_header import prepare_jit_header
from base_setup.plain import env_mode, plain_mlx, plain_mlx_scope
from base_setup.scipy_blas import route_to_scipy_openblas

logger = logging.getLogger("ppo_mlx")

# CPU flags (from /proc/cpuinfo) that each OpenBLAS core family executes.
_CORE_REQUIRED_FLAGS: dict[str, tuple[str, ...]] = {
    "ZEN": ("avx2", "fma"),
    "HASWELL": ("avx2", "fma"),
    "SKYLAKEX": ("avx512f", "avx512bw", "avx512vl", "avx512dq"),
    "COOPERLAKE": ("avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16"),
    "SAPPHIRERAPIDS": ("avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16"),
    "SANDYBRIDGE": ("avx",),
}


@dataclass(frozen=True)
class BlasInfo:
    """Which BLAS MLX uses in this process, and why.

    Attributes:
        name: ``"openblas"``, ``"accelerate"`` (macOS), or ``"reference"`` (the wheel's netlib BLAS).
        detail: a human-readable line (library path and build, or why OpenBLAS was not loaded).
    """

    name: str
    detail: str

    def describe(self) -> str:
        """The one log line: ``BLAS: <name> (<detail>)``."""
        return f"BLAS: {self.name} ({self.detail})"


_BLAS_INFO: BlasInfo | None = None


def _site_dirs() -> list[Path]:
    """Every site-packages directory of this interpreter (venv, user and system)."""
    dirs = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    dirs.update(p for p in sys.path if p.endswith("site-packages"))
    return [Path(d) for d in sorted(dirs) if Path(d).is_dir()]


def _find_one(pattern: str) -> Path | None:
    for site in _site_dirs():
        hits = sorted(glob.glob(str(site / pattern)))
        if hits:
            return Path(hits[0])
    return None


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def _load_libgfortran_from_numpy() -> str:
    """Make ``libgfortran.so.5`` resolvable using the copy bundled in NumPy's wheel.

    auditwheel renamed NumPy's copy (``libgfortran-<hash>.so.5.0.0``, soname likewise), so the dynamic
    linker would not match it to OpenBLAS's ``NEEDED libgfortran.so.5``. We load an in-memory copy
    whose soname string is rewritten to ``libgfortran.so.5`` (same length or shorter, so the ELF layout
    is unchanged); the linker matches already-loaded libraries by soname. Its own dependency,
    NumPy's renamed libquadmath, is loaded first by path so that its soname matches too.
    """
    gfortran = _find_one("numpy.libs/libgfortran-*.so*")
    quadmath = _find_one("numpy.libs/libquadmath-*.so*")
    if gfortran is None:
        raise OSError("libgfortran.so.5 is not installed and NumPy's wheel does not bundle one")
    if quadmath is not None:
        ctypes.CDLL(str(quadmath), os.RTLD_GLOBAL)
    data = gfortran.read_bytes()
    old = gfortran.name.encode() + b"\0"
    new = b"libgfortran.so.5\0"
    if data.count(old) != 1 or len(new) > len(old):
        raise OSError(f"cannot rename the soname of {gfortran}")
    data = data.replace(old, new + b"\0" * (len(old) - len(new)))
    fd = os.memfd_create("libgfortran.so.5")
    os.write(fd, data)
    # The descriptor stays open for the life of the process: the mapping is backed by it.
    ctypes.CDLL(f"/proc/self/fd/{fd}", os.RTLD_GLOBAL)
    return str(gfortran)


def _numpy_version() -> str:
    import importlib.metadata

    try:
        return importlib.metadata.version("numpy")
    except importlib.metadata.PackageNotFoundError:
        return "(not installed)"


def _load_openblas() -> BlasInfo:
    """OpenBLAS for MLX: scipy-openblas32 through trampolines (its kernels fit any x86-64 CPU:
    :mod:`base_setup.scipy_blas`), else the ``cmeel-openblas`` wheel (one CPU family), else the
    reference BLAS; ``PPO_MLX_BLAS=cmeel`` skips the first."""
    if os.environ.get("PPO_MLX_BLAS", "").lower() == "cmeel":
        return _load_cmeel_openblas("PPO_MLX_BLAS=cmeel")
    lib_path = _find_one("scipy_openblas32/lib/libscipy_openblas.so")
    if lib_path is None:
        return _load_cmeel_openblas("scipy-openblas32 is not installed")
    try:
        lib, trampolines = route_to_scipy_openblas(lib_path)
    except OSError as err:
        return _load_cmeel_openblas(f"scipy-openblas32 not used: {err}")
    threads = _record_openblas(lib)
    forced = forced_kernels_note(os.environ.get("OPENBLAS_CORETYPE"), lib.corename(), _cpu_flags())
    return BlasInfo(
        "openblas",
        f"{lib.config()} ({lib.corename()} kernels, {threads} threads) from {lib_path} through "
        f"{trampolines}{forced}",
    )


#: OpenBLAS's kernels that use AVX-512 (their names as ``openblas_get_corename`` gives them).
_AVX512_CORES = ("SKYLAKEX", "COOPERLAKE", "SAPPHIRERAPIDS")


def forced_kernels_note(coretype: str | None, core: str, flags: set[str]) -> str:
    """A note for :class:`BlasInfo`'s detail where ``OPENBLAS_CORETYPE`` (``coretype``) holds
    OpenBLAS to kernels without AVX-512 (``core``) on a CPU whose ``flags`` have what its
    SkylakeX kernels need; else "".

    Some machines set the variable because older OpenBLAS builds computed wrong results on
    newer CPUs; the current scipy-openblas32 picks its kernels by the CPU, and the AVX2 kernels
    do half the float32 multiply-adds per instruction (docs/environment.md has the figures).
    The note is in the detail only: a run logs it at debug level, as every working BLAS."""
    if not coretype or core.upper() in _AVX512_CORES:
        return ""
    if not set(_CORE_REQUIRED_FLAGS["SKYLAKEX"]) <= flags:
        return ""
    return (
        f"; OPENBLAS_CORETYPE={coretype} holds it to these kernels on a CPU with AVX-512: "
        "unset OPENBLAS_CORETYPE (and OPENBLAS_L2_SIZE) for its faster SkylakeX kernels"
    )


def _load_cmeel_openblas(why: str) -> BlasInfo:
    """The ``cmeel-openblas`` wheel's OpenBLAS (``why``: the reason scipy-openblas32 was not)."""
    info = _load_cmeel_wheel()
    return BlasInfo(info.name, f"{info.detail}; {why}")


def _load_cmeel_wheel() -> BlasInfo:
    lib_path = _find_one("cmeel.prefix/lib/libopenblas.so.0")
    if lib_path is None:
        return BlasInfo(
            "reference",
            "cmeel-openblas is not installed; MLX uses its reference BLAS (slow). "
            "Install it with: pip install cmeel-openblas==0.3.29",
        )
    gfortran_note = ""
    try:
        lib = ctypes.CDLL(str(lib_path), os.RTLD_LOCAL)
    except OSError as err:
        if "libgfortran" not in str(err):
            raise
        if _find_one("numpy.libs/libgfortran-*.so*") is None:
            # NumPy >= 2.5's Linux wheels no longer bundle a libgfortran to borrow.
            message = (
                f"{lib_path} needs libgfortran.so.5, which this system lacks and NumPy "
                f"{_numpy_version()} does not bundle; MLX keeps its reference BLAS (much "
                "slower matmuls). Fix: install the system library (Debian/Ubuntu: apt install "
                "libgfortran5; Fedora: dnf install libgfortran) or pip install 'numpy<2.5'"
            )
            return BlasInfo("reference", message)
        gfortran_note = f", libgfortran from {_load_libgfortran_from_numpy()}"
        lib = ctypes.CDLL(str(lib_path), os.RTLD_LOCAL)
    lib.openblas_get_corename.restype = ctypes.c_char_p
    lib.openblas_get_config.restype = ctypes.c_char_p
    core = (lib.openblas_get_corename() or b"").decode().upper()
    config = (lib.openblas_get_config() or b"").decode()
    needed = _CORE_REQUIRED_FLAGS.get(core)
    flags = _cpu_flags()
    if needed is None or not set(needed) <= flags:
        missing = sorted(set(needed or ("<unknown core>",)) - flags)
        return BlasInfo(
            "reference",
            f"{lib_path} is built for {core or 'an unknown CPU'} and this CPU lacks {missing}; "
            "MLX keeps its reference BLAS (slow but correct)",
        )
    # Re-opening an already-loaded library with RTLD_GLOBAL promotes its symbols to the global scope,
    # where libmlx's cblas_* references will bind when mlx.core is imported.
    ctypes.CDLL(str(lib_path), os.RTLD_GLOBAL)
    threads = _record_openblas(lib)
    return BlasInfo("openblas", f"{config} ({threads} threads) from {lib_path}{gfortran_note}")


_IMPORTED_FIRST = (
    "mlx was imported before base_setup.setup_blas() ran, so MLX's BLAS calls are bound to the "
    "wheel's reference BLAS (much slower matmuls). Fix: call `from base_setup import "
    "setup_blas; setup_blas()` at the top of your script, before importing mlx, mlx_lm or any "
    "package of this project"
)


def setup_blas() -> BlasInfo:
    """Give MLX a fast BLAS on Linux; idempotent, and a no-op on macOS.

    Must run before the first ``import mlx.core`` in the process. Logs one line saying which BLAS
    is in use (logger ``ppo_mlx``) and returns it: at debug level when all is as it should be, as
    a warning that says what to do when the fast BLAS could not be used (mlx imported first, the
    library missing or unusable). Set ``PPO_MLX_BLAS=reference`` to opt out.

    On Linux it also starts building, once per machine and MLX build, the precompiled header that
    makes MLX's CPU kernel compiler about four times faster (:mod:`base_setup.jit_header`;
    ``PPO_MLX_JIT_HEADER=0`` turns it off).
    """
    global _BLAS_INFO
    if _BLAS_INFO is not None:
        return _BLAS_INFO
    quiet_transformers_torch_advice()
    level = logging.DEBUG
    if sys.platform == "darwin":
        info = BlasInfo("accelerate", "macOS: MLX uses Accelerate / Metal; nothing to load")
    elif os.environ.get("PPO_MLX_BLAS", "").lower() == "reference":
        info = BlasInfo("reference", "PPO_MLX_BLAS=reference: OpenBLAS not loaded")
    elif not (sys.platform.startswith("linux") and platform.machine() == "x86_64"):
        info = BlasInfo("reference", f"no fast BLAS known for {sys.platform}/{platform.machine()}")
    elif "mlx.core" in sys.modules:
        info = BlasInfo("reference", _IMPORTED_FIRST)
        level = logging.WARNING
    else:
        info = _load_openblas()
        if info.name == "reference":
            level = logging.WARNING
    _BLAS_INFO = info
    logger.log(level, info.describe())
    prepare_jit_header()
    return info


class _NoTorchAdvice(logging.Filter):
    """Drops transformers' "PyTorch was not found" line: MLX needs no PyTorch, and its
    tokenizers, configs and chat templates (all this package uses) work without it."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("PyTorch was not found")


def quiet_transformers_torch_advice() -> None:
    """Keep transformers from telling every run that PyTorch is missing (its other messages
    stay); idempotent, and effective only before transformers is first imported."""
    root = logging.getLogger("transformers")
    if not any(isinstance(f, _NoTorchAdvice) for f in root.filters):
        root.addFilter(_NoTorchAdvice())


def blas_info() -> BlasInfo:
    """The BLAS chosen by :func:`setup_blas` (running it if it has not run yet: if mlx is
    imported by then, that logs the warning that the fast BLAS was missed)."""
    return setup_blas()


# ---------------------------------------------------------------------------------- BLAS threads
_ADAPT_ENV = "PPO_MLX_ADAPTIVE_BLAS"
#: The loaded OpenBLAS ("lib"), its thread count at load ("max_threads"), and the last CPU-time
#: sample of :func:`adapt_blas_threads` ("sample": machine busy seconds, own seconds, wall).
_OPENBLAS: dict[str, Any] = {}


def _record_openblas(lib: Any) -> int:
    """Keep ``lib`` as the loaded OpenBLAS and its thread count at the first load in the process
    as the most a run may use ("max_threads"); returns that count. Loaded again later (the
    loaders are called again by tests and tools), OpenBLAS may have a run's lower count set
    (:func:`run_blas_threads` under load), which must not become every later run's ceiling."""
    from base_setup import native

    _OPENBLAS["lib"] = lib
    native.set_threads(int(lib.openblas_get_num_threads()))
    return int(_OPENBLAS.setdefault("max_threads", int(lib.openblas_get_num_threads())))


def blas_threads() -> int | None:
    """OpenBLAS's thread count now (None without OpenBLAS)."""
    lib = _OPENBLAS.get("lib")
    return int(lib.openblas_get_num_threads()) if lib is not None else None


def _set_blas_threads(lib: Any, threads: int) -> None:
    """Set OpenBLAS's thread count, and the native kernels' (:mod:`base_setup.native`, if they
    are loaded) to the same: element-wise work then shares the cores the matmuls use."""
    from base_setup import native

    lib.openblas_set_num_threads(threads)
    native.set_threads(threads)


#: Shortest time between two load samples that :func:`adapt_blas_threads` acts on.
_MIN_SAMPLE_SECONDS = 0.2


def blas_threads_for_load(other_cores: float, cpus: int, max_threads: int) -> int:
    """BLAS threads that fit beside other processes: the cores they leave free, rounded, in
    ``[1, max_threads]``. ``other_cores``: cores other processes kept busy on average; ``cpus``:
    the machine's cores."""
    free = cpus - max(0.0, other_cores)
    return max(1, min(max_threads, math.floor(free + 0.5)))


def _cpu_sample() -> tuple[float, float, float] | None:
    """(busy CPU seconds of the whole machine, of this process, wall seconds); None without
    /proc/stat."""
    try:
        with open("/proc/stat", encoding="ascii") as f:
            fields = f.readline().split()
    except OSError:
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in fields[1:9])
    busy = (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")
    times = os.times()
    # This process's own time includes its children's, finished (os.times) or running
    # (MLX's JIT compiler: g++ and its cc1plus while they compile): this run's work, never
    # "other load".
    own = times.user + times.system + times.children_user + times.children_system
    return busy, own + _running_descendants_seconds(os.getpid()), time.monotonic()


def _running_descendants_seconds(pid: int) -> float:
    """CPU seconds of the processes below ``pid`` that have not been waited for yet (each one's
    own time plus that of its waited-for children); 0 where /proc lists no children."""
    ticks = 0
    pending, seen = [pid], {pid}
    while pending:
        parent = pending.pop()
        try:
            threads = os.listdir(f"/proc/{parent}/task")
        except OSError:
            continue
        for thread in threads:
            try:
                with open(f"/proc/{parent}/task/{thread}/children", encoding="ascii") as f:
                    children = [int(c) for c in f.read().split()]
            except (OSError, ValueError):
                continue
            for child in children:
                if child in seen:
                    continue
                seen.add(child)
                try:
                    with open(f"/proc/{child}/stat", encoding="ascii", errors="replace") as f:
                        stat = f.read()
                except OSError:
                    continue  # it ended meanwhile
                # After the ")" closing the command name: state, ..., utime (the 12th),
                # stime, cutime, cstime.
                ticks += sum(int(x) for x in stat.rsplit(")", 1)[1].split()[11:15])
                pending.append(child)
    return ticks / os.sysconf("SC_CLK_TCK")


def process_running(pid: int) -> bool:
    """Whether process ``pid`` exists on this host (this process included; another user's
    counts): what a leftover named after a process's pid is checked against before removal."""
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def parameter_count(model: Any) -> int:
    """The number of values in ``model``'s (an ``nn.Module``'s) parameters (a quantized weight
    counts its packed values)."""
    from mlx.utils import tree_flatten  # not at import: setup_blas runs before mlx loads

    leaves = cast(list[tuple[str, Any]], tree_flatten(model.parameters()))
    return sum(int(v.size) for _, v in leaves)


def blas_mode() -> str:
    """``PPO_MLX_ADAPTIVE_BLAS``: "run" (default; also "1"), "step", or "off" (also "0")."""
    aliases = {"run": "run", "1": "run", "step": "step", "0": "off", "off": "off"}
    return env_mode(_ADAPT_ENV, aliases, "run (the default), step or off")


def run_blas_threads(saved: int | None = None) -> int | None:
    """Fix OpenBLAS's thread count for a whole run; the trainers call it as a run starts.

    A fresh run (``saved`` None) measures, over a quarter of a second, how many cores other
    processes keep busy and takes :func:`blas_threads_for_load` (every thread on a quiet machine,
    with ``PPO_MLX_ADAPTIVE_BLAS=off``, or under plain MLX). A resumed run takes ``saved``, the
    count its checkpoint records: the thread count changes the order of a matmul's sums, so this
    is what makes a resumed run bit for bit the uninterrupted one, whatever the load now. Returns
    the count (to record in checkpoints), or None without OpenBLAS.
    """
    lib = _OPENBLAS.get("lib")
    if lib is None:
        return None
    max_threads = int(_OPENBLAS["max_threads"])
    if saved is None:
        _OPENBLAS.pop("warned_saved", None)  # a fresh run: the next resume may warn again
    if saved is not None:
        wanted = min(int(saved), max_threads)
        if wanted != int(saved) and _OPENBLAS.get("warned_saved") != saved:
            # Once per resume: the training loop takes the count before its first computation,
            # then the checkpoint's restore takes it again.
            _OPENBLAS["warned_saved"] = saved
            logger.warning(
                "the checkpoint was trained with %d BLAS threads but OpenBLAS has %d here: the "
                "resumed run will differ from an uninterrupted one by float rounding",
                saved,
                max_threads,
            )
    elif blas_mode() == "off" or plain_mlx():
        wanted = max_threads
    else:
        first = _cpu_sample()
        time.sleep(0.25)
        now = _cpu_sample()
        other = 0.0
        if first is not None and now is not None and now[2] > first[2]:
            other = ((now[0] - first[0]) - (now[1] - first[1])) / (now[2] - first[2])
        wanted = blas_threads_for_load(other, os.cpu_count() or 1, max_threads)
        if wanted < max_threads:
            logger.info(
                "BLAS threads for this run: %d (other processes keep %.1f of %d cores busy)",
                wanted,
                other,
                os.cpu_count() or 1,
            )
    _set_blas_threads(lib, wanted)
    _OPENBLAS.pop("sample", None)
    return wanted


def adapt_blas_threads() -> int | None:
    """With ``PPO_MLX_ADAPTIVE_BLAS=step``: fit OpenBLAS's threads to the cores other processes
    leave free, at every step (call it between steps). Otherwise a no-op returning None: the
    count stays the run's (:func:`run_blas_threads`).

    Why: OpenBLAS's threads wait for each other by spinning. When other processes keep the cores
    busy, a multi-threaded matmul waits for a thread the kernel has descheduled, and every matmul
    costs a scheduler time slice (docs/performance.md). So each call measures, from /proc/stat, how
    many cores other processes used since the previous call, and sets the thread count to
    :func:`blas_threads_for_load` (at most the count OpenBLAS started with: its default or
    ``OPENBLAS_NUM_THREADS``). A quiet machine keeps every thread.

    Changing the count mid-run changes the float rounding of every later matmul, so a run
    resumed from a checkpoint no longer reproduces the uninterrupted one bit for bit: hence not
    the default.

    Returns the thread count now set, or None where it does not apply: no OpenBLAS loaded (macOS,
    reference BLAS), a mode other than "step", plain MLX, no /proc/stat, or the first call (it only takes
    the first sample). Calls closer together than ``_MIN_SAMPLE_SECONDS`` keep the count and
    the sample. Call it
    only while no MLX computation is running: ``openblas_set_num_threads`` is not safe during a
    matmul (the trainers call it at the start of each step, after the last step's evaluation).
    """
    lib = _OPENBLAS.get("lib")
    if lib is None or blas_mode() != "step" or plain_mlx():
        return None
    now = _cpu_sample()
    if now is None:
        return None
    last = _OPENBLAS.get("sample")
    if last is not None and now[2] - last[2] < _MIN_SAMPLE_SECONDS:
        return int(lib.openblas_get_num_threads())
    _OPENBLAS["sample"] = now
    if last is None:
        return None
    other = ((now[0] - last[0]) - (now[1] - last[1])) / (now[2] - last[2])
    current = int(lib.openblas_get_num_threads())
    wanted = blas_threads_for_load(other, os.cpu_count() or 1, int(_OPENBLAS["max_threads"]))
    if wanted != current:
        _set_blas_threads(lib, wanted)
        logger.info(
            "BLAS threads %d -> %d: other processes kept %.1f of %d cores busy",
            current,
            wanted,
            other,
            os.cpu_count() or 1,
        )
    return wanted


_STREAMS_ENV = "PPO_MLX_CPU_STREAMS"


def cpu_streams_mode() -> str:
    """``PPO_MLX_CPU_STREAMS``: "on" (default; also "1") or "off" (also "0")."""
    aliases = {"on": "on", "1": "on", "0": "off", "off": "off"}
    return env_mode(_STREAMS_ENV, aliases, "on (the default) or off")


@contextmanager
def side_by_side(count: int = 2) -> Iterator[list[Any]]:
    """Lanes for ``count`` independent computations that MLX's CPU backend runs side by side.

    Yields ``count`` context managers. Arrays built inside lane ``i`` go to a CPU stream of their
    own; evaluated together (one ``mx.eval`` or ``mx.async_eval`` of all), each stream's thread
    runs its graph while the others run theirs. MLX's CPU element-wise ops run on their stream's
    one thread, so one stream keeps one core busy outside the matmuls; two keep two. Meanwhile
    OpenBLAS runs each matmul on the run's threads divided among the lanes (1 each on 2 cores:
    more would spin against each other), and on leaving the block every lane is waited for and
    the run's count is restored. The split is a fixed function of the run's thread count (which a
    resumed run takes back from its checkpoint), so a resumed run still computes the same sums.

    Where lanes cannot help, every lane is a no-op context (the default stream, the thread count
    untouched): MLX's default device is not the CPU (a GPU runs its queue in parallel already),
    OpenBLAS was not loaded (macOS's Accelerate, the reference BLAS: no thread control), the run
    has one BLAS thread (a busy machine), ``PPO_MLX_CPU_STREAMS=off``, or plain MLX
    (:mod:`base_setup.plain`).
    Nothing computed inside may change the thread count (:func:`adapt_blas_threads` runs
    between steps only).
    """
    import mlx.core as mx

    from base_setup.plain import speed_tricks

    lib = _OPENBLAS.get("lib")
    threads = int(lib.openblas_get_num_threads()) if lib is not None else 1
    if count < 2 or threads < 2 or cpu_streams_mode() == "off" or not speed_tricks():
        yield [nullcontext() for _ in range(count)]
        return
    assert lib is not None
    streams = _lane_streams(count)
    _set_blas_threads(lib, max(1, threads // count))
    try:
        yield [mx.stream(s) for s in streams]
    finally:
        for s in streams:
            mx.synchronize(s)  # nothing of a lane runs once the thread count changes back
        _set_blas_threads(lib, threads)


@contextmanager
def decoding_threads(enabled: bool = True) -> Iterator[int | None]:
    """The block where a generation decodes: OpenBLAS and the native kernels on at most one
    core fewer than this process may run on (at least one), the run's count restored on leaving.
    Yields the count in force (None: untouched). ``enabled``: False leaves the count alone (the
    trainers pass whether the policy is a model the few-row kernel serves,
    ``base_setup.fast_layers.FEW_ROW_MIN_PARAMETERS``: the small test, golden and demo models
    keep their bits, which OpenBLAS's thread count changes).

    A decoding step keeps two threads busy: MLX's stream computes the step while the Python
    thread builds and queues the next step's graph (``mx.async_eval`` in
    :mod:`ppo_trainer.generator`). A kernel split over every core takes the Python thread's
    core, and the next step then waits for its graph: on two cores a small model's step is
    faster with its kernels on one thread (docs/performance.md, "A decoding step's threads").
    The count is a fixed function of the run's and the machine's, so a resumed run decodes as
    the uninterrupted one did. Untouched where OpenBLAS was not loaded, under plain MLX
    (:mod:`base_setup.plain`), or when the run's count already leaves a core free.
    """
    import mlx.core as mx

    from base_setup import native
    from base_setup.plain import speed_tricks

    lib, threads = _OPENBLAS.get("lib"), blas_threads() or 1
    wanted = max(1, min(threads, native.process_cpus() - 1))
    if not enabled or lib is None or wanted == threads or not speed_tricks():
        yield None
        return
    mx.synchronize()  # no matmul runs while the count changes
    _set_blas_threads(lib, wanted)
    try:
        yield wanted
    finally:
        mx.synchronize()
        _set_blas_threads(lib, threads)


#: CPU streams of :func:`side_by_side`, made once per process (MLX streams are not freed).
_LANES: list[Any] = []


def _lane_streams(count: int) -> list[Any]:
    import mlx.core as mx

    while len(_LANES) < count:
        _LANES.append(mx.new_stream(mx.cpu))
    return _LANES[:count]


def evaluate_in_groups(arrays: Sequence[Any], group_bytes: int) -> int:
    """``mx.eval`` of ``arrays`` in consecutive groups of about ``group_bytes`` (an array larger
    than that is a group of its own), so that what their graphs create and free in between
    lives one group at a time: evaluated in one go, MLX runs each operation for every array
    before the next operation, and holds every intermediate at once. Returns the number of
    evaluations."""
    import mlx.core as mx

    group: list[Any] = []
    size = evaluations = 0
    for a in arrays:
        group.append(a)
        size += a.nbytes
        if size >= group_bytes:
            mx.eval(group)
            group, size, evaluations = [], 0, evaluations + 1
    if group:
        mx.eval(group)
        evaluations += 1
    return evaluations


#: MLX's default limit on the freed buffers its CPU backend keeps for reuse.
MLX_CPU_DEFAULT_CACHE_BYTES = 32 << 20
#: This project's default limit on the CPU, within each phase of work: MLX's own.
CPU_CACHE_BYTES = MLX_CPU_DEFAULT_CACHE_BYTES
_CACHE_ENV = "PPO_MLX_CPU_CACHE_MB"
_CACHE_STATE: dict[str, int | None] = {}


def setup_cpu_buffer_cache() -> int | None:
    """Take charge of MLX's CPU buffer cache for a run: its limit, and emptying it at the end of
    each phase of work; idempotent.

    MLX's CPU backend keeps freed buffers up to a limit (:data:`MLX_CPU_DEFAULT_CACHE_BYTES`);
    past that, a freed buffer goes back to the C library, which returns large ones to the
    kernel, and the next allocation of that size takes fresh pages. The limit is set to
    :data:`CPU_CACHE_BYTES` (MLX's own) and the cache is emptied at the end of each phase (a
    generation, the scoring passes, one optimiser step: :func:`release_cached_buffers`), so that
    the buffers a phase frees serve that phase's later allocations but never stay resident
    beside the next phase's, which allocates other sizes.

    Not larger: every byte the cache holds is resident memory above MLX's arrays. A quarter of
    the memory limit (an earlier default) added gigabytes to the peak of a PPO update at real
    shapes, and 256 MiB (the default after it) raised the peak too, at both real shapes, for no
    measurable speed (docs/performance.md).

    Acts only when the default device is the CPU, plain MLX is not asked for
    (:mod:`base_setup.plain`), and the limit is still MLX's default (a limit set by the caller
    is kept, and its cache never emptied). ``PPO_MLX_CPU_CACHE_MB`` sets another limit in MiB
    (phases still empty it). Returns the limit now in force in bytes, or None where nothing was
    changed. A run sets it up and undoes it with :func:`run_buffer_cache`.
    """
    if "limit" in _CACHE_STATE:
        return _CACHE_STATE["limit"]
    import mlx.core as mx

    from base_setup.plain import speed_tricks

    limit: int | None = None
    if speed_tricks():
        env = os.environ.get(_CACHE_ENV)
        wanted = CPU_CACHE_BYTES
        if env is not None:
            try:
                wanted = int(float(env) * (1 << 20))
            except (ValueError, OverflowError):  # "lots", "nan", "inf"
                raise ValueError(
                    f"{_CACHE_ENV}={env!r} is not a number of MiB; unset it or give e.g. 256"
                ) from None
            if wanted < 0:
                raise ValueError(f"{_CACHE_ENV} must be >= 0 MiB, got {env}")
        previous = mx.set_cache_limit(wanted)
        if previous != MLX_CPU_DEFAULT_CACHE_BYTES and env is None:
            mx.set_cache_limit(previous)  # the caller's own choice stands
        else:
            limit = wanted
            _CACHE_STATE["previous"] = previous
            logger.debug("MLX CPU buffer cache limit: %d MiB", wanted >> 20)
    _CACHE_STATE["limit"] = limit
    return limit


def release_cached_buffers() -> None:
    """The end of a phase of work (a generation, the scoring passes, one optimiser step):
    empty MLX's CPU buffer cache. Does nothing unless :func:`setup_cpu_buffer_cache` set the
    limit (the CPU device, no limit of the caller's)."""
    if not _CACHE_STATE.get("limit"):
        return
    import mlx.core as mx

    mx.clear_cache()


@contextmanager
def generation_buffer_cache() -> Iterator[None]:
    """A generation's phase: the cache emptied before (whatever the work since the last phase
    left) and after (:func:`release_cached_buffers`)."""
    release_cached_buffers()
    try:
        yield
    finally:
        release_cached_buffers()


@contextmanager
def run_buffer_cache() -> Iterator[int | None]:
    """The buffer-cache policy of one run (:func:`setup_cpu_buffer_cache`), undone on exit:
    MLX's cache emptied and its limit put back to what it was, also on an exception. Yields
    the limit in force (None: MLX's own, untouched). Nested blocks (a step inside a run) share
    the outermost one's policy."""
    if "limit" in _CACHE_STATE:  # an enclosing run's
        yield _CACHE_STATE["limit"]
        return
    try:
        yield setup_cpu_buffer_cache()
    finally:
        previous = _CACHE_STATE.get("previous")
        _CACHE_STATE.clear()
        if previous is not None:
            import mlx.core as mx

            mx.clear_cache()
            mx.set_cache_limit(previous)


@contextmanager
def run_scope(plain: bool = False) -> Iterator[None]:
    """What a trainer holds while it works (builds models, steps, trains, evaluates) and undoes
    after: plain MLX when ``plain`` (its config's ``plain_mlx``; :mod:`base_setup.plain`), and
    the run's buffer-cache policy (:func:`run_buffer_cache`; none under plain MLX)."""
    with plain_mlx_scope(plain), run_buffer_cache():
        yield


def seed_everything(seed: int) -> None:
    """Seed MLX, NumPy and Python's ``random`` from one integer."""
    import mlx.core as mx
    import numpy as np

    if seed < 0:
        raise ValueError(f"seed must be a non-negative integer, got {seed}")
    random.seed(seed)
    np.random.seed(seed % (2**32))
    mx.random.seed(seed)


def step_seed(seed: int, step: int) -> int:
    """The seed of one training step's randomness (sampling, dropout): a function of the run's
    seed and the step alone, so a resumed run draws exactly what an uninterrupted one would,
    with no random state to carry."""
    return (seed * 1_000_003 + step) % (2**63)
