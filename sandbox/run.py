"""Running a program and its tests in the sandbox: :func:`run_tests` (one program),
:func:`run_tests_many` and :func:`score_completions` (many, in parallel),
:func:`detect_isolation` (the strongest layers that work here), and :func:`extract_code` (the
program in a completion).

A run starts the launcher (:mod:`sandbox.launcher`) in ``python -I -S -B``, gives it a payload on
stdin (nonce, code, and each check's setup and expression; never an expected value), reads the
records from a pipe of their own and the output into a capped buffer, then kills every process
of the run and deletes its files, whatever the outcome. The launcher and runner are real files of
this package; their source text travels in the command line, so the child needs no file of
ours (in the strongest mode it has its own mount namespace and uid).
"""

from __future__ import annotations

import functools
import json
import logging
import os
import re
import secrets
import selectors
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from sandbox import isolation as host
from sandbox import launcher, seccomp
from sandbox.isolation import IS_LINUX, LaunchError
from sandbox.limits import Isolation, SandboxLimits, TestResult, rlimits
from sandbox.records import Channel, summarize
from sandbox.runner import MAX_VALUE_BYTES
from sandbox.tests_spec import Check, parse_tests

#: Prefix of the host working directories (fallback modes); the pid lets tests find their own.
WORKDIR_PREFIX = f"code_sandbox_{os.getpid()}_"
_WORKDIR_IN_PRIVATE_TMP = "/tmp/sandbox"
_LAUNCH_RETRIES = 2
#: A pipe that went past its cap (``max_output_bytes``, or the result channel's) by more than
#: :data:`FREE_DISCARD_BYTES` is read once per this interval, 64 KiB at a time: a candidate that
#: floods it waits on the full pipe, and the trainer pays a few reads a second instead of reading
#: the flood as fast as it comes (docs/reliability.md has the figures).
THROTTLED_READ_INTERVAL_S = 0.05
#: Bytes past the cap read and dropped at full speed before the throttle starts, so that a chatty
#: honest program is not slowed.
FREE_DISCARD_BYTES = 32 << 20
#: What the candidate's root holds besides its scratch space (the strong modes), or the only
#: places it may read (the weak mode, through Landlock): the interpreter's installation and the
#: system's shared libraries, read-only. A symbolic link among them is recreated as a link.
_SYSTEM_LIBRARIES = (
    "/lib",
    "/lib32",
    "/lib64",
    "/usr/lib",
    "/usr/lib32",
    "/usr/lib64",
    "/etc/ld.so.cache",
)
logger = logging.getLogger(__name__)


_FENCE = re.compile(r"```[ \t]*([\w+-]*)[^\n]*\n(.*?)(?:```|\Z)", re.DOTALL)


def extract_code(completion: str) -> str:
    """The code in a completion: the first fenced block tagged ``python``/``py``/``python3``,
    else the first untagged fenced block, else the whole text. An unterminated fence (a completion
    cut off at the token limit) runs to the end of the text."""
    untagged = None
    for match in _FENCE.finditer(completion):
        tag = match.group(1).lower()
        if tag in ("python", "py", "python3"):
            return match.group(2).rstrip()
        if tag == "" and untagged is None:
            untagged = match.group(2).rstrip()
    return untagged if untagged is not None else completion.strip()


@functools.cache
def _script(name: str) -> str:
    """The source text of ``sandbox/<name>.py``, run in the child with ``-c``."""
    return (Path(__file__).parent / f"{name}.py").read_text()


def run_tests(
    code: str,
    tests: Sequence[str],
    limits: SandboxLimits | None = None,
    isolation: Isolation | None = None,
) -> TestResult:
    """Run ``code``, then each test (e.g. ``"assert add(1, 2) == 3"``), in a sandbox.

    Each test is parsed here (:mod:`sandbox.tests_spec`): the sandbox evaluates only the
    expression (``add(1, 2)``) and returns its value as plain data; whether it equals the
    expected value (``3``, never sent) is decided in this process. The tests run in order in the
    namespace the code defined; a test whose expression raises fails and the next one still runs.

    Args:
        code: the candidate program (untrusted).
        tests: test snippets (trusted), in the forms :data:`sandbox.tests_spec.ACCEPTED_FORMS`.
        limits: resource limits; ``SandboxLimits()`` when None.
        isolation: the layers to use; :func:`detect_isolation` (the strongest available) when None.

    Returns:
        The outcome; never raises because of what ``code`` does.

    Raises:
        ValueError: ``tests`` is empty, or a test does not compile or is not an accepted form.
        RuntimeError: the sandbox itself could not be started (not the code's fault).
    """
    limits = SandboxLimits() if limits is None else limits
    checks = _checked_inputs(code, tests)
    isolation = _allowed(detect_isolation() if isolation is None else isolation, limits)
    return _run_with_retries(code, checks, limits, isolation)


def _run_with_retries(
    code: str, checks: list[tuple[Check, ...]], limits: SandboxLimits, isolation: Isolation
) -> TestResult:
    failures = []
    for attempt in range(_LAUNCH_RETRIES + 1):  # set-up failures may be transient (EAGAIN, ENOMEM)
        try:
            return _run_once(code, checks, limits, isolation)
        except LaunchError as exc:
            failures.append(str(exc))
            time.sleep(0.05 * (attempt + 1))
    raise RuntimeError(
        f"could not start the code sandbox ({isolation.describe()}): " + " | ".join(failures)
    )


def run_tests_many(
    codes: Sequence[str],
    tests: Sequence[Sequence[str]],
    limits: SandboxLimits | None = None,
    max_workers: int | None = None,
) -> list[TestResult]:
    """:func:`run_tests` for many programs in parallel; ``tests[i]`` belongs to ``codes[i]``.
    Every test is parsed before any sandbox starts.

    At most ``max_workers`` sandboxes run at once (default ``max(1, cpu_count // 2)``, so that
    training keeps cores); each runs at ``limits.niceness``.
    """
    if len(codes) != len(tests):
        raise ValueError(
            f"codes and tests must have the same length, got {len(codes)} and {len(tests)}: "
            "pass one list of tests per program"
        )
    limits = SandboxLimits() if limits is None else limits
    checks = [_checked_inputs(code, test_list) for code, test_list in zip(codes, tests)]
    workers = max(1, (os.cpu_count() or 2) // 2) if max_workers is None else max_workers
    if workers < 1:
        raise ValueError(f"max_workers must be >= 1, got {max_workers}")
    isolation = _allowed(detect_isolation(), limits)
    if not codes:
        return []
    with ThreadPoolExecutor(max_workers=min(workers, len(codes))) as pool:
        futures = [
            pool.submit(_run_with_retries, code, program_checks, limits, isolation)
            for code, program_checks in zip(codes, checks)
        ]
        return [future.result() for future in futures]


def score_completions(
    codes: Sequence[str],
    tests: Sequence[Sequence[str]],
    limits: SandboxLimits | None = None,
    max_workers: int | None = None,
) -> list[float]:
    """Fraction of passed tests, in [0, 1], for each program (see :func:`run_tests_many`)."""
    return [r.fraction for r in run_tests_many(codes, tests, limits, max_workers)]


_detect_lock = threading.Lock()
_detected: Isolation | None = None


def detect_isolation(refresh: bool = False) -> Isolation:
    """The strongest :class:`Isolation` that works here, found once by running a canary program
    under each candidate in turn (cached; ``refresh=True`` probes again). Weak candidates (no
    namespaces) are tried last; :func:`run_tests` refuses them unless
    ``SandboxLimits.isolation == "weak"``.

    Raises:
        RuntimeError: not even the weakest works (e.g. not a POSIX system).
    """
    global _detected
    with _detect_lock:
        if _detected is not None and not refresh:
            return _detected
        if os.name != "posix":
            raise RuntimeError("the code sandbox needs a POSIX system (Linux or macOS)")
        failures = []
        for candidate in candidate_isolations():
            reason = probe_isolation(candidate)
            if reason is None:
                _detected = candidate
                return candidate
            failures.append(f"{candidate.describe()}: {reason}")
        raise RuntimeError("no code sandbox configuration works here:\n" + "\n".join(failures))


def candidate_isolations() -> list[Isolation]:
    """Every isolation this machine might offer, strongest first."""
    root = os.geteuid() == 0
    kernel = IS_LINUX and seccomp.machine() in seccomp.SYSCALLS  # seccomp's tables
    landlock = kernel and launcher.landlock_abi(launcher.Libc()) >= 1
    layers = {"seccomp": kernel, "landlock": landlock}
    candidates = []
    if IS_LINUX:
        namespaces = {"network_namespace": True, "private_mounts": True, "pid_namespace": True}
        if root:
            candidates.append(Isolation(True, audit_hook=False, **namespaces, **layers))
        # Root without CAP_SYS_ADMIN (a container) owns a user namespace as a fresh uid, which
        # must be able to reach the interpreter (not under /root); a user owns one as itself.
        owner = {"separate_uid": root, "user_namespace": True}
        candidates.append(Isolation(**owner, audit_hook=False, **namespaces, **layers))
    if root:
        candidates.append(Isolation(True, False, False, False, True, **layers))
    candidates.append(Isolation(False, False, False, False, True, **layers))
    return candidates


def weak_isolation_gaps(isolation: Isolation) -> list[str]:
    """What a candidate can still do under ``isolation`` (empty for a strong one)."""
    if isolation.strong:
        return []
    gaps = []
    if not isolation.landlock:
        gaps.append(
            "read every file the sandbox's user can read (the task file with the tests, "
            "SSH keys, tokens) and, without a separate uid, write and delete the trainer "
            "user's files"
        )
    if not isolation.seccomp:
        gaps += [
            "signal, trace or read the memory of other processes of the same user (the trainer)",
            "open network and Unix sockets, create kernel keys and SysV IPC objects that "
            "outlive the run, and start processes that outlive it (a new session)",
        ]
    gaps.append(
        "see the host's processes and mounts, and fill the working directory's file system "
        f"with files of up to max_file_size_mb each"
    )
    gaps.append("the audit hook it runs under is turned off from Python in a few lines")
    return gaps


_warned: set[Isolation] = set()


def _allowed(isolation: Isolation, limits: SandboxLimits) -> Isolation:
    """``isolation``, if ``limits`` allows it; warn once per weak isolation used."""
    gaps = weak_isolation_gaps(isolation)
    if not gaps:
        _harden_trainer()
        return isolation
    if limits.isolation != "weak":
        raise RuntimeError(
            f"the code sandbox can only run with weak isolation here ({isolation.describe()}: "
            "no user or mount namespaces), where untrusted code can "
            + "; ".join(gaps)
            + ". Run as root or enable user namespaces (sysctl kernel.unprivileged_userns_clone=1"
            ", user.max_user_namespaces > 0), or accept this with SandboxLimits(isolation="
            '"weak") (--sandbox-isolation weak)'
        )
    _harden_trainer()
    if isolation not in _warned:
        _warned.add(isolation)
        logger.warning(
            "code sandbox: weak isolation (%s) accepted; untrusted code can %s",
            isolation.describe(),
            "; ".join(gaps),
        )
    return isolation


@functools.cache
def _harden_trainer() -> None:
    """Mark the trainer non-dumpable (Linux): no process of its user can read its memory or
    environment through /proc or ptrace (a candidate of the weak modes runs as that user)."""
    if IS_LINUX:
        libc = launcher.Libc()
        libc.prctl(4, 0, "PR_SET_DUMPABLE")


def probe_isolation(isolation: Isolation) -> str | None:
    """None if a canary program runs correctly under ``isolation``, else the reason it does not."""
    code = "import os\ndef uid():\n    return os.getuid()\n"
    separate = isolation.separate_uid or isolation.user_namespace
    tests = ["assert uid() != 0"] if separate else ["assert uid() is not None"]
    try:
        result = _run_once(code, parse_tests(tests), SandboxLimits(timeout_s=20.0), isolation)
    except LaunchError as exc:
        return str(exc)
    if result.status != "ok" or result.passed != result.total:
        return f"canary run gave status {result.status!r}: {result.detail} {result.output[-500:]}"
    return None


def _checked_inputs(code: str, tests: Sequence[str]) -> list[tuple[Check, ...]]:
    if not isinstance(code, str):
        raise ValueError(f"code must be a str, got {type(code).__name__}")
    if isinstance(tests, str) or len(tests) == 0:
        raise ValueError("tests must be a non-empty list of test snippets (one str per test)")
    return parse_tests(tuple(tests))


@functools.cache
def _read_paths(interpreter: str) -> list[str]:
    """The interpreter's installation and the shared-library directories (see
    :data:`_SYSTEM_LIBRARIES`)."""
    prefixes = {os.path.realpath(sys.base_prefix), os.path.realpath(sys.base_exec_prefix)}
    paths = sorted(prefixes) + [p for p in _SYSTEM_LIBRARIES if os.path.lexists(p)]
    if not any(interpreter.startswith(p + os.sep) for p in prefixes):
        paths.append(interpreter)
    return paths


@functools.cache
def _seccomp_program(pid_namespace: bool) -> str:
    """The seccomp filter (:mod:`sandbox.seccomp`) in hex, the launcher's pid left for it to fill
    in (:func:`sandbox.launcher.with_own_pid`)."""
    return seccomp.seccomp_program(launcher.OWN_PID_PLACEHOLDER, pid_namespace).hex()


def _run_once(
    code: str, checks: list[tuple[Check, ...]], limits: SandboxLimits, isolation: Isolation
) -> TestResult:
    """One sandboxed run; raises LaunchError if the sandbox could not be set up."""
    interpreter = os.path.realpath(sys.executable)
    nonce = secrets.token_hex(16)
    uid = host.pick_uid() if isolation.separate_uid else None
    workdir = _WORKDIR_IN_PRIVATE_TMP
    host_workdir = None if isolation.private_mounts else tempfile.mkdtemp(prefix=WORKDIR_PREFIX)
    proc: subprocess.Popen[bytes] | None = None
    result_r, result_w = os.pipe()
    try:
        if host_workdir is not None:
            workdir = host_workdir
        env = {
            "PATH": "/usr/bin:/bin",
            "LANG": "C.UTF-8",
            "HOME": workdir,
            "TMPDIR": workdir,
            "PYTHONDONTWRITEBYTECODE": "1",
        }
        config = {
            "result_fd": result_w,
            "uid": uid,
            "separate_uid": isolation.separate_uid,
            "network_namespace": isolation.network_namespace,
            "private_mounts": isolation.private_mounts,
            "pid_namespace": isolation.pid_namespace,
            "audit_hook": isolation.audit_hook,
            "user_namespace": isolation.user_namespace,
            "seccomp": isolation.seccomp,
            "landlock": isolation.landlock,
            "landlock_reads": not isolation.private_mounts,
            "read_paths": _read_paths(interpreter),
            "write_paths": [os.path.dirname(workdir) if isolation.private_mounts else workdir],
            "workdir": workdir,
            "interpreter": interpreter,
            "rlimits": rlimits(limits, isolation),
            "niceness": limits.niceness,
            "disk_mb": limits.max_disk_mb,
            "env": env,
            "runner": _script("runner"),
            "seccomp_program": (
                _seccomp_program(isolation.pid_namespace) if isolation.seccomp else ""
            ),
        }
        # What the sandbox gets of each test: its setup statements and the expression to
        # evaluate. The expected values stay in `checks`, in this process.
        tests = [[[c.setup, c.expression] for c in test] for test in checks]
        with tempfile.TemporaryFile() as payload:
            payload.write(json.dumps({"nonce": nonce, "code": code, "tests": tests}).encode())
            payload.seek(0)
            proc = subprocess.Popen(
                [interpreter, "-I", "-S", "-B", "-c", _script("launcher"), json.dumps(config)],
                stdin=payload,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                pass_fds=(result_w,),
                cwd="/",
                env=env,
                start_new_session=True,
                close_fds=True,
            )
        os.close(result_w)
        result_w = -1
        assert proc.stdout is not None
        output = Channel(proc.stdout.fileno(), limits.max_output_bytes)
        n_checks = sum(len(test) for test in checks)
        results = Channel(result_r, 65536 + (MAX_VALUE_BYTES + 1024) * n_checks)
        timed_out = _wait(proc, output, results, nonce, limits.timeout_s)
        stray = _cleanup(proc, uid, host_workdir, interpreter, isolation)
        uid = host_workdir = None
        output.drain()  # every writer is dead now: what is left in the pipes is final
        results.drain()
        returncode = proc.returncode
        if isolation.pid_namespace and 128 < returncode < 128 + 65:
            # The launcher reports its pid 1's "killed by signal N" as exit code 128 + N (an
            # os._exit(128 + N) of the candidate reads the same; only the detail text differs).
            returncode = 128 - returncode
    finally:
        if uid is not None or host_workdir is not None or (proc and proc.returncode is None):
            _cleanup(proc, uid, host_workdir, interpreter, isolation)  # after an exception
        if proc is not None and proc.stdout is not None:
            proc.stdout.close()
        for fd in (result_r, result_w):
            if fd >= 0:
                os.close(fd)
    result = summarize(output, results, nonce, checks, limits, timed_out, returncode, stray)
    if isinstance(result, str):
        raise LaunchError(result)
    return result


def _wait(
    proc: subprocess.Popen[bytes], output: Channel, results: Channel, nonce: str, timeout: float
) -> bool:
    """Read both pipes until the runner reports done, the process exits or the deadline passes;
    returns True on timeout.

    A pipe that went past its cap by :data:`FREE_DISCARD_BYTES` is throttled: read once (64 KiB)
    every :data:`THROTTLED_READ_INTERVAL_S`, so that a candidate flooding it waits on a full
    pipe instead of costing the trainer a CPU second per program.
    """
    done_marker = f"{nonce} done ".encode()
    error_marker = f"{nonce} error ".encode()
    deadline = time.monotonic() + timeout
    throttled: dict[Channel, float] = {}  # channel -> when it may be read next
    with selectors.DefaultSelector() as selector:
        selector.register(output.fd, selectors.EVENT_READ, output)
        selector.register(results.fd, selectors.EVENT_READ, results)
        pidfd = -1
        if hasattr(os, "pidfd_open"):
            try:
                pidfd = os.pidfd_open(proc.pid)
                selector.register(pidfd, selectors.EVENT_READ, None)
            except OSError:  # kernels before 5.3
                pidfd = -1
        try:
            while True:
                now = time.monotonic()
                remaining = deadline - now
                if remaining <= 0:
                    return True
                wait = remaining if pidfd >= 0 else min(remaining, 0.02)
                if throttled:
                    wait = max(0.0, min(wait, min(throttled.values()) - now))
                ready = [key.data for key, _ in selector.select(wait)]
                if None in ready:
                    return False  # the process exited
                now = time.monotonic()
                ready += [c for c, due in throttled.items() if due <= now]
                for channel in ready:
                    try:
                        channel.read()
                    except BlockingIOError:  # a throttled pipe with nothing in it
                        pass
                    if channel in throttled:
                        throttled[channel] = now + THROTTLED_READ_INTERVAL_S
                    if not channel.open:
                        throttled.pop(channel, None)
                        if channel.fd in selector.get_map():
                            selector.unregister(channel.fd)
                    elif channel.dropped > FREE_DISCARD_BYTES and channel not in throttled:
                        selector.unregister(channel.fd)
                        os.set_blocking(channel.fd, False)
                        throttled[channel] = now + THROTTLED_READ_INTERVAL_S
                if results in ready and (
                    done_marker in results.data or error_marker in results.data
                ):
                    return False
                if pidfd < 0 and proc.poll() is not None:
                    return False
        finally:
            if pidfd >= 0:
                os.close(pidfd)


def _cleanup(
    proc: subprocess.Popen[bytes] | None,
    uid: int | None,
    workdir: str | None,
    interpreter: str,
    isolation: Isolation,
) -> list[int]:
    """Kill every process of the run, reap the child, delete its files; returns pids that
    survived (normally none)."""

    def kill_uid() -> list[int]:
        if uid is None:
            return []
        if IS_LINUX:
            return host.kill_processes_of_uid(uid)
        host.kill_uid_portable(uid, interpreter)
        return []

    if proc is not None and isolation.pid_namespace and proc.poll() is None:
        # The launcher kills its pid 1 on SIGTERM and exits once the kernel has killed every
        # process of the namespace (wherever they moved: new sessions, daemons).
        proc.terminate()
        try:
            proc.wait(timeout=2.0)
        except subprocess.TimeoutExpired:
            pass
    if not (isolation.pid_namespace and proc is not None and proc.returncode is not None):
        kill_uid()  # the candidate's processes, wherever they moved (new sessions, daemons)
    if proc is not None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        proc.kill()
        proc.wait()
    stray = kill_uid()  # anything forked while the launcher was still setting up
    if workdir is not None:
        host.force_rmtree(workdir)
    if uid is not None:
        if not isolation.private_mounts:  # else it never saw the host's /tmp
            host.sweep_world_writable(uid)
        host.release_uid(uid)
    return stray
