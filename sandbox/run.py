"""Run untrusted generated code against unit tests, in a separate, limited, disposable process.

The code-generation task scores a completion by the fraction of its unit tests that pass. The
completion is untrusted: it may loop forever, fork, allocate 10 GB, print megabytes, delete files,
open sockets, call ``sys.exit`` or signal the trainer. Each call to :func:`run_tests` therefore:

1. starts ``python -I -S -B`` (isolated mode, stdlib only, no bytecode files) through a small
   launcher that sets up the isolation layers below and then ``exec``s the test runner;
2. gives it a fresh working directory (also ``HOME`` and ``TMPDIR``), a minimal environment, stdin
   from a payload file, and a wall-clock deadline;
3. reads the per-test results from a pipe of their own, each record tagged with a random nonce;
   stdout and stderr are read into a buffer capped at ``max_output_bytes`` and never parsed;
4. kills every process the run left behind and deletes its files, whatever the outcome.

Layers, by platform (see :class:`Isolation`, and :func:`detect_isolation` for the one in use):

===========================  ===================================  ==============================
protection                   Linux as root (CAP_SYS_ADMIN)        fallback (macOS, non-root)
===========================  ===================================  ==============================
wall-clock timeout           SIGKILL of every process             SIGKILL of the process group
CPU, memory, file size       RLIMIT_CPU / AS / FSIZE              same, where the OS enforces it
processes (fork bomb)        RLIMIT_NPROC on a fresh uid          audit hook blocks fork/exec
signals to the trainer       invisible (PID namespace) and EPERM  audit hook blocks ``os.kill``
network                      empty network namespace              userns+netns if allowed, else
                                                                  the audit hook
files outside its directory  every mount read-only; /tmp,         audit hook blocks writes
                             /var/tmp, /dev/shm one private       outside its directory
                             tmpfs that vanishes with the run
SysV / POSIX IPC objects     private IPC namespace                RLIMIT_MSGQUEUE = 0
leftover processes           PID namespace dies with its pid 1;   process-group kill
                             /proc sweep of the uid
trainer killed mid-run       PDEATHSIG chain kills everything     the direct child dies (Linux)
===========================  ===================================  ==============================

Root without ``CAP_SYS_ADMIN`` (a plain container) gets the fresh uid with the audit hook, if
the interpreter is readable by other users (the strongest mode also works when it is not, e.g.
under ``/root/.pyenv``: it binds the interpreter's prefix into its own mount namespace). The
audit hook (PEP 578) is not a security boundary: it stops naive hostile code, not a determined
attacker (``ctypes`` and ``_posixsubprocess`` cannot be imported, so neither can modules that need
them, such as ``subprocess`` and ``asyncio``; other bypasses exist).

The candidate gets the standard library only (``-S``), runs with ``__name__ == "__sandbox__"``
(so an ``if __name__ == "__main__":`` block does not run), and its tests run in order in the
namespace it defined, under one wall-clock limit for the whole run.

Residual risks, stated honestly:

* Scoring runs in the candidate's interpreter. The nonce stops printed or blindly written fake
  results, but a candidate that searches the runner's memory (``gc``, frames) can find it and forge
  passes; so can objects whose ``__eq__`` always returns True. The sandbox contains the code; it
  does not make ``assert``-based tests ungameable.
* Up to ``max_processes`` processes each get ``memory_mb`` of address space.
* The candidate can read world-readable files (it has no network to send them anywhere in the
  Linux root mode; it can print them into its captured output).
* Without the PID namespace, processes a candidate forks and that are killed are reparented to
  the host's init, which must reap them; and a trainer killed mid-run leaves grandchildren alive
  until their CPU limit.
"""

from __future__ import annotations

import json
import os
import random
import re
import secrets
import selectors
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Literal

Status = Literal["ok", "error", "timeout", "crashed"]

_IS_LINUX = sys.platform.startswith("linux")
# Prefix of the host working directories (fallback modes); the pid lets tests find their own.
WORKDIR_PREFIX = f"code_sandbox_{os.getpid()}_"
# Preferred range of the per-run uids (and gids) when running as root: far from real accounts.
SANDBOX_UID_RANGE = (1_900_000_000, 1_900_000_000 + (1 << 24))
_WORKDIR_IN_PRIVATE_TMP = "/tmp/sandbox"
_LAUNCH_ERROR = b"LAUNCH_ERROR "
_LAUNCH_RETRIES = 2


@dataclass
class SandboxLimits:
    """Resource limits of one sandboxed run (candidate code plus all of its tests).

    Attributes:
        timeout_s: wall-clock limit of the whole run; on expiry every process is SIGKILLed.
        cpu_time_s: CPU seconds per process (RLIMIT_CPU; SIGKILL at the limit).
        memory_mb: address space per process (RLIMIT_AS); allocations beyond it raise MemoryError.
        max_processes: processes and threads the candidate may have (RLIMIT_NPROC on its fresh
            uid; without one, the fallback blocks fork and exec altogether).
        max_file_size_mb: largest file the code may write (RLIMIT_FSIZE).
        max_disk_mb: size of the private tmpfs holding its directory and /tmp (Linux root mode).
        max_output_bytes: stdout+stderr bytes kept; the rest is read and discarded.
        niceness: added scheduling niceness, so that scoring yields the CPU to training.
    """

    timeout_s: float = 5.0
    cpu_time_s: int = 5
    memory_mb: int = 512
    max_processes: int = 8
    max_file_size_mb: int = 1
    max_disk_mb: int = 16
    max_output_bytes: int = 64_000
    niceness: int = 10

    def __post_init__(self) -> None:
        checks = [
            (self.timeout_s > 0, "timeout_s", "> 0"),
            (self.cpu_time_s >= 1, "cpu_time_s", ">= 1"),
            (self.memory_mb >= 64, "memory_mb", ">= 64 (the Python interpreter needs it)"),
            (self.max_processes >= 1, "max_processes", ">= 1"),
            (self.max_file_size_mb >= 1, "max_file_size_mb", ">= 1"),
            (self.max_disk_mb >= self.max_file_size_mb, "max_disk_mb", ">= max_file_size_mb"),
            (self.max_output_bytes >= 0, "max_output_bytes", ">= 0"),
            (0 <= self.niceness <= 19, "niceness", "in [0, 19]"),
        ]
        for ok, name, rule in checks:
            if not ok:
                raise ValueError(
                    f"SandboxLimits.{name} must be {rule}, got {getattr(self, name)!r}"
                )


@dataclass(frozen=True)
class Isolation:
    """Which isolation layers a run uses (see the module docstring for what each one stops).

    Attributes:
        separate_uid: run as a fresh unprivileged uid/gid (needs root); NPROC then counts only
            the run's own processes, the trainer cannot be signalled, root files are read-only,
            and every leftover process is found by its uid.
        network_namespace: an empty network namespace (Linux; as non-root via a user namespace).
        private_mounts: a mount namespace in which every host mount is read-only and /tmp,
            /var/tmp and /dev/shm are one private tmpfs of ``max_disk_mb`` (Linux root), plus
            a private IPC namespace.
        pid_namespace: a PID namespace whose pid 1 reaps orphans; the candidate sees none of
            the host's processes, and when it ends the kernel kills everything it started, even
            if the trainer itself was killed (Linux root, with ``private_mounts``).
        audit_hook: in-interpreter blocks (PEP 578) on sockets, fork/exec, ctypes, signals to
            other processes and writes outside the working directory; a best-effort layer.
    """

    separate_uid: bool
    network_namespace: bool
    private_mounts: bool
    pid_namespace: bool
    audit_hook: bool

    def __post_init__(self) -> None:
        if self.private_mounts and not self.separate_uid:
            raise ValueError(
                "Isolation.private_mounts needs separate_uid=True: a process that keeps root "
                "could remount the file system writable"
            )
        if self.pid_namespace and not self.private_mounts:
            raise ValueError(
                "Isolation.pid_namespace needs private_mounts=True (to mount its own /proc)"
            )

    def describe(self) -> str:
        """One line naming the active layers, for logs."""
        names = [
            ("separate_uid", self.separate_uid),
            ("network_namespace", self.network_namespace),
            ("private_mounts", self.private_mounts),
            ("pid_namespace", self.pid_namespace),
            ("audit_hook", self.audit_hook),
        ]
        return "rlimits, process group, " + ", ".join(n for n, on in names if on)


@dataclass
class TestResult:
    """Outcome of one sandboxed run.

    Attributes:
        passed: tests that ran to completion without raising.
        total: tests given.
        status: ``"ok"`` every test ran; ``"error"`` the candidate's top-level code raised
            (including SyntaxError and ``sys.exit``), so no test ran; ``"timeout"`` the wall-clock
            limit expired; ``"crashed"`` the process ended before reporting every test (``os._exit``,
            a signal, a resource limit). Tests that reported a pass before a timeout or a crash
            still count.
        detail: a short human-readable explanation.
        output: the first ``max_output_bytes`` of the run's stdout and stderr.
    """

    __test__ = False  # not a pytest test class, despite the name

    passed: int
    total: int
    status: Status
    detail: str
    output: str = ""

    @property
    def fraction(self) -> float:
        """``passed / total``, in [0, 1]."""
        return self.passed / self.total


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


def run_tests(
    code: str,
    tests: Sequence[str],
    limits: SandboxLimits | None = None,
    isolation: Isolation | None = None,
) -> TestResult:
    """Run ``code`` and then each test snippet (e.g. ``"assert add(1, 2) == 3"``) in a sandbox.

    The tests run in order in the namespace the code defined; a test that raises anything
    (AssertionError, an exception, SystemExit) fails and the next one still runs.

    Args:
        code: the candidate program (untrusted).
        tests: test snippets (trusted; each must compile).
        limits: resource limits; ``SandboxLimits()`` when None.
        isolation: the layers to use; :func:`detect_isolation` (the strongest available) when None.

    Returns:
        The outcome; never raises because of what ``code`` does.

    Raises:
        ValueError: ``tests`` is empty or a test does not compile.
        RuntimeError: the sandbox itself could not be started (not the code's fault).
    """
    limits = SandboxLimits() if limits is None else limits
    _check_inputs(code, tests)
    isolation = detect_isolation() if isolation is None else isolation
    failures = []
    for attempt in range(_LAUNCH_RETRIES + 1):  # set-up failures may be transient (EAGAIN, ENOMEM)
        try:
            return _run_once(code, list(tests), limits, isolation)
        except _LaunchError as exc:
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

    At most ``max_workers`` sandboxes run at once (default ``max(1, cpu_count // 2)``, so that
    training keeps cores); each runs at ``limits.niceness``.
    """
    if len(codes) != len(tests):
        raise ValueError(
            f"codes and tests must have the same length, got {len(codes)} and {len(tests)}: "
            "pass one list of tests per program"
        )
    limits = SandboxLimits() if limits is None else limits
    for code, test_list in zip(codes, tests):
        _check_inputs(code, test_list)
    workers = max(1, (os.cpu_count() or 2) // 2) if max_workers is None else max_workers
    if workers < 1:
        raise ValueError(f"max_workers must be >= 1, got {max_workers}")
    isolation = detect_isolation()
    if not codes:
        return []
    with ThreadPoolExecutor(max_workers=min(workers, len(codes))) as pool:
        futures = [pool.submit(run_tests, c, t, limits, isolation) for c, t in zip(codes, tests)]
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
    under each candidate in turn (cached; ``refresh=True`` probes again).

    Raises:
        RuntimeError: not even the fallback works (e.g. not a POSIX system).
    """
    global _detected
    with _detect_lock:
        if _detected is not None and not refresh:
            return _detected
        if os.name != "posix":
            raise RuntimeError("the code sandbox needs a POSIX system (Linux or macOS)")
        root = os.geteuid() == 0
        candidates = []
        if root:
            if _IS_LINUX:
                candidates.append(Isolation(True, True, True, True, False))
            candidates.append(Isolation(True, False, False, False, True))
        elif _IS_LINUX:
            candidates.append(Isolation(False, True, False, False, True))
        candidates.append(Isolation(False, False, False, False, True))
        failures = []
        for candidate in candidates:
            reason = probe_isolation(candidate)
            if reason is None:
                _detected = candidate
                return candidate
            failures.append(f"{candidate.describe()}: {reason}")
        raise RuntimeError("no code sandbox configuration works here:\n" + "\n".join(failures))


def probe_isolation(isolation: Isolation) -> str | None:
    """None if a canary program runs correctly under ``isolation``, else the reason it does not."""
    code = "import os\nuid = os.getuid()\n"
    tests = ["assert uid != 0"] if isolation.separate_uid else ["assert isinstance(uid, int)"]
    try:
        result = _run_once(code, tests, SandboxLimits(timeout_s=20.0), isolation)
    except _LaunchError as exc:
        return str(exc)
    if result.status != "ok" or result.passed != result.total:
        return f"canary run gave status {result.status!r}: {result.detail} {result.output[-500:]}"
    return None


# ---------------------------------------------------------------------------------------------
# The launcher: runs as the trainer's user (root in the strong mode), sets up the isolation
# layers, drops privileges and execs the runner. A separate interpreter rather than a
# preexec_fn, because preexec_fn is unsafe in a threaded parent (the trainer is threaded).
# ---------------------------------------------------------------------------------------------
_LAUNCHER_SRC = r"""
import json, os, resource, sys

cfg = json.loads(sys.argv[1])
if cfg["result_fd"] != 3:
    os.dup2(cfg["result_fd"], 3)
    os.close(cfg["result_fd"])
linux = sys.platform.startswith("linux")


def fail(step, exc):
    os.write(3, f"LAUNCH_ERROR {step}: {exc}\n".encode("ascii", "replace"))
    os._exit(125)


def main():
    step = "start"
    try:
        if linux:
            import ctypes

            libc = ctypes.CDLL(None, use_errno=True)
            libc.mount.argtypes = [ctypes.c_char_p] * 3 + [ctypes.c_ulong, ctypes.c_char_p]

            def check(rc, what):
                if rc != 0:
                    err = ctypes.get_errno()
                    raise OSError(err, f"{what}: {os.strerror(err)}")

            def mount(src, dst, fstype, flags, data=None):
                enc = lambda s: None if s is None else s.encode()
                check(libc.mount(enc(src), enc(dst), enc(fstype), flags, enc(data)), "mount " + dst)

            def die_with_parent():  # PR_SET_PDEATHSIG; cleared by fork and by setuid
                check(libc.prctl(1, 9, 0, 0, 0), "PR_SET_PDEATHSIG")

        flags = 0
        if cfg["network_namespace"]:
            flags |= 0x40000000  # CLONE_NEWNET
            if not cfg["separate_uid"]:
                flags |= 0x10000000  # CLONE_NEWUSER: lets a non-root user own a netns
        if cfg["private_mounts"]:
            flags |= 0x00020000 | 0x08000000  # CLONE_NEWNS | CLONE_NEWIPC
        if cfg["pid_namespace"]:
            flags |= 0x20000000  # CLONE_NEWPID: our next child is pid 1 of a new namespace
        if flags:
            step = "unshare"
            check(libc.unshare(flags), "unshare")
        if cfg["private_mounts"]:
            step = "private mounts"
            private_mounts(mount)
        workdir = cfg["workdir"]
        if cfg["private_mounts"]:
            os.makedirs(workdir, mode=0o700)
        if cfg["separate_uid"]:
            os.chown(workdir, cfg["uid"], cfg["uid"])
        os.chdir(workdir)
        step = "rlimits"
        set_rlimits()
        os.nice(cfg["niceness"])
        if cfg["pid_namespace"]:
            step = "pid namespace"
            die_with_parent()
            init = os.fork()
            if init:
                # The launcher (still root, outside the namespace the candidate can see) waits
                # and passes the status on; when init exits the kernel kills the namespace.
                os._exit(exit_code(os.waitpid(init, 0)[1]))
            MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_RDONLY = 2, 4, 8, 1
            mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC | MS_RDONLY)
        if cfg["separate_uid"]:
            step = "drop privileges"
            os.setgroups([])
            os.setgid(cfg["uid"])
            os.setuid(cfg["uid"])
        if linux:
            step = "prctl"
            check(libc.prctl(38, 1, 0, 0, 0), "PR_SET_NO_NEW_PRIVS")
            die_with_parent()
        if cfg["pid_namespace"]:
            step = "init"
            runner = os.fork()
            if runner:
                run_init(runner)
            die_with_parent()
        step = "exec"
        interp = cfg["interpreter"]
        argv = [interp, "-I", "-S", "-B", "-c", cfg["runner"], "3", str(int(cfg["audit_hook"])), workdir]
        os.execve(interp, argv, cfg["env"])
    except (OSError, ValueError) as exc:
        fail(step, exc)


def set_rlimits():
    for name, (soft, hard) in cfg["rlimits"].items():
        res = getattr(resource, name, None)
        if res is None:
            if linux:
                raise ValueError(f"resource.{name} is missing")
            continue
        cur_hard = resource.getrlimit(res)[1]
        if cur_hard != resource.RLIM_INFINITY:
            soft, hard = min(soft, cur_hard), min(hard, cur_hard)
        try:
            resource.setrlimit(res, (soft, hard))
        except (ValueError, OSError):
            if linux:
                raise


def exit_code(status):  # a wait status as an exit code; death by signal N becomes 128 + N
    code = os.waitstatus_to_exitcode(status)
    return 128 - code if code < 0 else code


def run_init(runner):
    # Pid 1 of the sandbox: reap every orphan; exit with the runner's status, which makes the
    # kernel kill and reap whatever is left in the namespace.
    import signal

    signal.signal(signal.SIGINT, signal.SIG_DFL)  # pid 1 ignores default-action signals
    os.close(3)
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    while True:
        try:
            pid, status = os.waitpid(-1, 0)
        except ChildProcessError:
            os._exit(125)
        if pid == runner:
            os._exit(exit_code(status))


def private_mounts(mount):
    MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT = 1, 2, 4, 8, 32
    MS_NOATIME, MS_NODIRATIME, MS_BIND, MS_REC = 1024, 2048, 4096, 16384
    MS_PRIVATE, MS_RELATIME, MS_STRICTATIME = 1 << 18, 1 << 21, 1 << 24
    keep = {"nosuid": MS_NOSUID, "nodev": MS_NODEV, "noexec": MS_NOEXEC, "noatime": MS_NOATIME,
            "nodiratime": MS_NODIRATIME, "relatime": MS_RELATIME, "strictatime": MS_STRICTATIME}
    mount(None, "/", None, MS_REC | MS_PRIVATE)
    # The interpreter may live under a directory other users cannot enter (/root/.pyenv): keep
    # an O_PATH handle on its prefix, to bind it back under a world-readable tmpfs below.
    prefix = cfg["prefix"]
    hidden = None
    parts = prefix.strip("/").split("/")
    for i in range(1, len(parts) + 1):
        path = "/" + "/".join(parts[:i])
        if not os.stat(path).st_mode & 0o001:
            hidden = path
            break
    prefix_fd = os.open(prefix, os.O_PATH | os.O_DIRECTORY) if hidden else None
    seen = set()
    with open("/proc/self/mountinfo") as f:
        mountinfo = f.read().splitlines()
    for line in mountinfo:
        fields = line.split()
        point = __import__("re").sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), fields[4])
        if point in seen:
            continue
        seen.add(point)
        extra = 0
        for opt in fields[5].split(","):
            extra |= keep.get(opt, 0)
        try:
            mount(None, point, None, MS_REMOUNT | MS_BIND | MS_RDONLY | extra)
        except OSError as exc:
            if exc.errno not in (2, 13):  # ENOENT, EACCES: a mount point hidden from us
                raise
    size = cfg["disk_mb"]
    mount("tmpfs", "/tmp", "tmpfs", MS_NOSUID | MS_NODEV, f"size={size}m,nr_inodes=4096,mode=1777")
    for other in ("/var/tmp", "/dev/shm"):
        if os.path.isdir(other):
            mount("/tmp", other, None, MS_BIND)
    if hidden:
        mount("tmpfs", hidden, "tmpfs", MS_NOSUID | MS_NODEV, "size=64k,nr_inodes=64,mode=755")
        os.makedirs(prefix, mode=0o755)
        mount(f"/proc/self/fd/{prefix_fd}", prefix, None, MS_BIND | MS_REC)
        mount(None, prefix, None, MS_REMOUNT | MS_BIND | MS_RDONLY)
        mount(None, hidden, None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)
        os.close(prefix_fd)


main()
"""

# ---------------------------------------------------------------------------------------------
# The runner: the candidate's interpreter. Everything it needs is bound to locals before the
# candidate runs, so that patching builtins or modules cannot change what it reports.
# ---------------------------------------------------------------------------------------------
_RUNNER_SRC = r"""
import builtins, json, os, sys


def _audit_hook(workdir):
    realpath, sep, getpid = os.path.realpath, os.sep, os.getpid
    root = realpath(workdir)
    write_flags = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
    blocked = ("socket.", "ctypes.", "subprocess.", "os.fork", "os.exec", "os.posix_spawn",
               "os.spawn", "os.system", "os.startfile", "os.killpg", "pty.", "signal.pidfd")
    path_args = {"os.remove": (0,), "os.rmdir": (0,), "os.mkdir": (0,), "os.rename": (0, 1),
                 "os.link": (0, 1), "os.symlink": (1,), "os.chmod": (0,), "os.chown": (0,),
                 "os.truncate": (0,), "os.utime": (0,), "shutil.rmtree": (0,),
                 "os.chflags": (0,), "os.lchflags": (0,), "os.setxattr": (0,),
                 "os.removexattr": (0,)}
    modules = {"_ctypes", "_posixsubprocess"}  # their C calls raise no audit event
    busy = []

    def inside(path):
        if isinstance(path, bytes):
            path = path.decode("utf-8", "surrogateescape")
        if not isinstance(path, str):
            return True  # a file descriptor: checked when it was opened
        full = realpath(path)
        return full == root or full.startswith(root + sep) or full == "/dev/null"

    def hook(event, args):
        if busy:
            return
        busy.append(1)
        try:
            if event == "open":
                flags = args[2]
                if isinstance(flags, int) and flags & write_flags and not inside(args[0]):
                    raise PermissionError(f"sandbox: writing {args[0]!r} is blocked")
            elif event in path_args:
                for i in path_args[event]:
                    if i < len(args) and not inside(args[i]):
                        raise PermissionError(f"sandbox: {event} on {args[i]!r} is blocked")
            elif event == "os.kill":
                if args[0] != getpid():
                    raise PermissionError("sandbox: signals to other processes are blocked")
            elif event == "import":
                if args[0] in modules:
                    raise PermissionError(f"sandbox: importing {args[0]} is blocked")
            elif event.startswith(blocked):
                raise PermissionError(f"sandbox: {event} is blocked")
        finally:
            busy.pop()

    sys.addaudithook(hook)


def _main():
    fd, hook, workdir = int(sys.argv[1]), sys.argv[2] == "1", sys.argv[3]
    payload = json.loads(sys.stdin.buffer.read())
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)  # the payload (and its nonce) is no longer reachable through stdin
    os.close(null)
    os.set_inheritable(fd, False)
    nonce, code, tests = payload["nonce"], payload["code"], payload["tests"]
    del payload
    write, exit_, flushes = os.write, os._exit, (sys.stdout.flush, sys.stderr.flush)
    exec_, compile_, ascii_, type_, str_ = exec, compile, ascii, type, str
    settrace, setprofile, BaseException_ = sys.settrace, sys.setprofile, BaseException

    def report(kind, index, message=""):
        write(fd, f"{nonce} {kind} {index} {message}\n".encode("ascii"))

    def describe(exc):
        try:
            message = str_(exc)
            text = ascii_(type_(exc).__name__ + (": " + message if message else ""))[1:-1]
        except BaseException_:  # the candidate's own __str__ may raise anything
            text = "<unprintable exception>"
        return text[:300]

    def finish(kind, message=""):
        for flush in flushes:  # the interpreter's own stdout and stderr, bound at start
            try:
                flush()
            except BaseException_:  # a closed or broken stdout is the candidate's business
                pass
        report(kind, -1, message)
        exit_(0)  # skip atexit handlers, finalizers and threads the candidate left behind

    namespace = {"__name__": "__sandbox__", "__builtins__": builtins}
    report("start", -1)
    if hook:
        _audit_hook(workdir)
    try:
        exec_(compile_(code, "<candidate>", "exec"), namespace)
    except BaseException_ as exc:  # SyntaxError, any exception, SystemExit: the code is broken
        finish("error", describe(exc))
    for index, test in enumerate(tests):
        settrace(None)
        setprofile(None)
        try:
            exec_(compile_(test, f"<test {index}>", "exec"), namespace)
        except BaseException_ as exc:  # a failing test never stops the others
            report("fail", index, describe(exc))
        else:
            report("pass", index)
    finish("done")


_main()
"""


class _LaunchError(Exception):
    """The sandbox could not be set up (the launcher failed before the candidate ran)."""


def _check_inputs(code: str, tests: Sequence[str]) -> None:
    if not isinstance(code, str):
        raise ValueError(f"code must be a str, got {type(code).__name__}")
    if isinstance(tests, str) or len(tests) == 0:
        raise ValueError("tests must be a non-empty list of test snippets (one str per test)")
    for i, test in enumerate(tests):
        if not isinstance(test, str):
            raise ValueError(f"tests[{i}] must be a str, got {type(test).__name__}")
        try:
            compile(test, f"<test {i}>", "exec")
        except SyntaxError as exc:
            raise ValueError(f"tests[{i}] does not compile ({exc}): fix the test {test!r}") from exc


_uid_lock = threading.Lock()
_uids_in_use: set[int] = set()


def _id_ranges(path: str) -> list[tuple[int, int]]:
    """Mapped id intervals ``[start, end)`` of this user namespace (everything off Linux)."""
    if not _IS_LINUX:
        return [(0, 1 << 32)]
    with open(path) as f:
        rows = [line.split() for line in f if line.strip()]
    return [(int(inside), int(inside) + int(count)) for inside, _, count in rows]


def _pick_uid() -> int:
    """A random uid (used as gid too) no account, group or running process uses."""
    ranges = [
        (max(a, c), min(b, d))
        for a, b in _id_ranges("/proc/self/uid_map")
        for c, d in _id_ranges("/proc/self/gid_map")
        if max(a, c) < min(b, d)
    ]
    low, high = SANDBOX_UID_RANGE
    if not any(a <= low and high <= b for a, b in ranges):
        a, b = max(ranges, key=lambda r: r[1] - r[0])
        low, high = max(a, 10_000, (a + b) // 2), b - 1
        if low >= high:
            raise _LaunchError("no unused uid range is mapped in this user namespace")
    taken = set()
    for table in ("/etc/passwd", "/etc/group"):
        if os.path.exists(table):
            with open(table, errors="replace") as f:
                taken |= {
                    int(r[2]) for r in (ln.split(":") for ln in f) if len(r) > 2 and r[2].isdigit()
                }
    rng = random.SystemRandom()
    for _ in range(100):
        uid = rng.randrange(low, high)
        with _uid_lock:
            if uid in taken or uid in _uids_in_use or _processes_of_uid(uid):
                continue
            _uids_in_use.add(uid)
            return uid
    raise _LaunchError(f"could not find an unused uid in [{low}, {high})")


def _processes_of_uid(uid: int) -> list[int]:
    """Pids of live (non-zombie) processes whose real, effective, saved or fs uid is ``uid``."""
    if not _IS_LINUX:
        return []
    pids = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/status") as f:
                status = f.read()
        except (FileNotFoundError, ProcessLookupError):
            continue
        fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
        if fields.get("State", "").strip().startswith(("Z", "X")):
            continue
        if str(uid) in fields.get("Uid", "").split():
            pids.append(int(entry.name))
    return pids


def _kill_processes_of_uid(uid: int, deadline_s: float = 5.0) -> list[int]:
    """SIGKILL every process of ``uid`` until none is left (Linux); returns the pids that were
    still alive when ``deadline_s`` ran out (empty on success)."""
    deadline = time.monotonic() + deadline_s
    while True:
        pids = _processes_of_uid(uid)
        if not pids or time.monotonic() > deadline:
            return pids
        for pid in pids:
            try:
                # A pidfd pins the process we checked, so a recycled pid is never signalled.
                pidfd = os.pidfd_open(pid)
            except ProcessLookupError:
                continue
            except OSError:  # no pidfd (kernel < 5.3): a pid recycled just now is a tiny risk
                if uid in _status_uids(pid):
                    os.kill(pid, signal.SIGKILL)
                continue
            try:
                if uid in _status_uids(pid):
                    signal.pidfd_send_signal(pidfd, signal.SIGKILL)
            except ProcessLookupError:
                pass
            finally:
                os.close(pidfd)
        time.sleep(0.005)


def _status_uids(pid: int) -> set[int]:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("Uid:"):
                    return {int(x) for x in line.split()[1:]}
    except FileNotFoundError:
        pass
    return set()


def _kill_uid_portable(uid: int, interpreter: str) -> None:
    """Off Linux: ``kill(-1, SIGKILL)`` as ``uid`` signals every process of that uid at once."""
    script = f"import os\nos.setgid({uid})\nos.setuid({uid})\nos.kill(-1, 9)\n"
    subprocess.run([interpreter, "-I", "-S", "-c", script], check=False, timeout=30)


def _force_rmtree(path: str) -> None:
    """Delete ``path`` even if the candidate made parts of it read-only or unreadable."""

    def make_writable_and_retry(
        func: Callable[[str], object], failed_path: str, _exc: object
    ) -> None:
        parent = os.path.dirname(failed_path)
        for p in (parent, failed_path):
            try:
                os.chmod(p, stat.S_IRWXU)
            except FileNotFoundError:
                pass
        func(failed_path)

    if os.path.lexists(path):
        shutil.rmtree(path, onerror=make_writable_and_retry)


def _sweep_world_writable(uid: int) -> None:
    """Without private mounts: delete what ``uid`` left at the top of the world-writable dirs."""
    for top in ("/tmp", "/var/tmp", "/dev/shm"):
        try:
            entries = list(os.scandir(top))
        except FileNotFoundError:
            continue
        for entry in entries:
            try:
                if entry.stat(follow_symlinks=False).st_uid != uid:
                    continue
                if entry.is_dir(follow_symlinks=False):
                    _force_rmtree(entry.path)
                else:
                    os.unlink(entry.path)
            except FileNotFoundError:
                pass


def _signal_name(returncode: int) -> str:
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exit code {returncode}"


class _Channel:
    """A pipe read into a capped buffer: bytes past ``cap`` are read and dropped (the writer never
    blocks on a full pipe, and the trainer's memory stays bounded)."""

    def __init__(self, fd: int, cap: int) -> None:
        self.fd, self.cap = fd, cap
        self.data = bytearray()
        self.dropped = 0
        self.open = True

    def read(self) -> None:
        chunk = os.read(self.fd, 65536)
        if not chunk:
            self.open = False
            return
        room = self.cap - len(self.data)
        self.data += chunk[: max(room, 0)]
        self.dropped += max(len(chunk) - max(room, 0), 0)

    def drain(self) -> None:
        """Read whatever is left without blocking (after every writer was killed)."""
        os.set_blocking(self.fd, False)
        while self.open:
            try:
                self.read()
            except BlockingIOError:
                return


@dataclass
class _Records:
    """The runner's reports, parsed; a line without the nonce is counted, never trusted."""

    launch_error: str | None = None
    started: bool = False
    done: bool = False
    code_error: str | None = None
    outcomes: dict[int, str | None] = field(default_factory=dict)  # None: passed; else why not
    forged: int = 0


def _parse_records(data: bytes, nonce: str, total: int) -> _Records:
    records = _Records()
    lines = data.split(b"\n")[:-1]  # a last line without "\n" is incomplete
    if lines and lines[0].startswith(_LAUNCH_ERROR):
        # Only the launcher can write before the runner's "start" record.
        records.launch_error = lines[0][len(_LAUNCH_ERROR) :].decode("ascii", "replace")
        return records
    for line in lines:
        parts = line.decode("ascii", "replace").split(" ", 3)
        if len(parts) < 3 or parts[0] != nonce or not parts[2].lstrip("-").isdigit():
            records.forged += 1
            continue
        kind, index, message = parts[1], int(parts[2]), parts[3] if len(parts) > 3 else ""
        if kind == "start":
            records.started = True
        elif kind in ("pass", "fail") and 0 <= index < total and index not in records.outcomes:
            records.outcomes[index] = None if kind == "pass" else message
        elif kind == "error" and records.code_error is None:
            records.code_error = message
        elif kind == "done":
            records.done = True
    return records


def _run_once(
    code: str, tests: list[str], limits: SandboxLimits, isolation: Isolation
) -> TestResult:
    """One sandboxed run; raises _LaunchError if the sandbox could not be set up."""
    interpreter = os.path.realpath(sys.executable)
    nonce = secrets.token_hex(16)
    uid = _pick_uid() if isolation.separate_uid else None
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
            "workdir": workdir,
            "prefix": os.path.realpath(sys.base_prefix),
            "interpreter": interpreter,
            "rlimits": _rlimits(limits, isolation),
            "niceness": limits.niceness,
            "disk_mb": limits.max_disk_mb,
            "env": env,
            "runner": _RUNNER_SRC,
        }
        with tempfile.TemporaryFile() as payload:
            payload.write(json.dumps({"nonce": nonce, "code": code, "tests": tests}).encode())
            payload.seek(0)
            proc = subprocess.Popen(
                [interpreter, "-I", "-S", "-B", "-c", _LAUNCHER_SRC, json.dumps(config)],
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
        output = _Channel(proc.stdout.fileno(), limits.max_output_bytes)
        results = _Channel(result_r, 65536 + 1024 * len(tests))
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
    return _summarize(output, results, nonce, len(tests), limits, timed_out, returncode, stray)


def _rlimits(limits: SandboxLimits, isolation: Isolation) -> dict[str, tuple[int, int]]:
    """``resource`` limit name -> (soft, hard) for the runner."""
    mb = 1 << 20
    processes = limits.max_processes + (1 if isolation.pid_namespace else 0)  # + its pid 1
    return {
        # soft == hard: SIGKILL at the limit, not SIGXCPU (whose default action dumps core)
        "RLIMIT_CPU": (limits.cpu_time_s, limits.cpu_time_s),
        "RLIMIT_AS": (limits.memory_mb * mb, limits.memory_mb * mb),
        "RLIMIT_FSIZE": (limits.max_file_size_mb * mb, limits.max_file_size_mb * mb),
        "RLIMIT_NPROC": (processes, processes),
        "RLIMIT_CORE": (0, 0),  # a core dump would be a file left behind
        "RLIMIT_NOFILE": (64, 64),
        "RLIMIT_MSGQUEUE": (0, 0),  # POSIX message queues outlive their process
    }


def _wait(
    proc: subprocess.Popen[bytes], output: _Channel, results: _Channel, nonce: str, timeout: float
) -> bool:
    """Read both pipes until the runner reports done, the process exits or the deadline passes;
    returns True on timeout."""
    done_marker = f"{nonce} done ".encode()
    error_marker = f"{nonce} error ".encode()
    deadline = time.monotonic() + timeout
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
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return True
                for key, _ in selector.select(remaining if pidfd >= 0 else min(remaining, 0.02)):
                    channel = key.data
                    if channel is None:
                        return False  # the process exited
                    channel.read()
                    if not channel.open:
                        selector.unregister(channel.fd)
                if done_marker in results.data or error_marker in results.data:
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
        if _IS_LINUX:
            return _kill_processes_of_uid(uid)
        _kill_uid_portable(uid, interpreter)
        return []

    kill_uid()  # the candidate's processes, wherever they moved (new sessions, daemons)
    if proc is not None:
        if isolation.pid_namespace:
            # Its pid 1 is dead now: let the launcher reap it and exit, rather than orphan a
            # zombie on a host init that may never reap it.
            try:
                proc.wait(timeout=1.0)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        proc.kill()
        proc.wait()
    stray = kill_uid()  # anything forked while the launcher was still setting up
    if workdir is not None:
        _force_rmtree(workdir)
    if uid is not None:
        _sweep_world_writable(uid)
        with _uid_lock:
            _uids_in_use.discard(uid)
    return stray


def _summarize(
    output: _Channel,
    results: _Channel,
    nonce: str,
    total: int,
    limits: SandboxLimits,
    timed_out: bool,
    returncode: int,
    stray: list[int],
) -> TestResult:
    records = _parse_records(bytes(results.data), nonce, total)
    text = output.data.decode("utf-8", "replace")
    if records.launch_error is not None:
        raise _LaunchError(records.launch_error)
    passed = sum(1 for v in records.outcomes.values() if v is None)
    notes = []
    if output.dropped:
        notes.append(
            f"{output.dropped} output bytes past the {limits.max_output_bytes} cap dropped"
        )
    if records.forged:
        notes.append(f"{records.forged} result lines without the nonce ignored")
    if stray:
        notes.append(f"processes {stray} could not be killed")
    status: Status
    if records.code_error is not None:
        status, passed = "error", 0
        detail = f"the code raised before any test ran: {records.code_error}"
    elif records.done:
        status = "ok"
        failures = [f"test {i}: {m}" for i, m in sorted(records.outcomes.items()) if m is not None]
        detail = f"{passed}/{total} tests passed" + "".join(f"; {f}" for f in failures[:3])
    elif timed_out:
        status = "timeout"
        detail = f"wall-clock limit of {limits.timeout_s} s reached; {passed}/{total} tests passed"
    elif not records.started:
        raise _LaunchError(
            f"the runner ended before starting ({_signal_name(returncode)}): {text[-2000:]}"
        )
    else:
        status = "crashed"
        detail = (
            f"the process ended before reporting every test ({_signal_name(returncode)}); "
            f"{passed}/{total} tests passed"
        )
    if notes:
        detail += " (" + "; ".join(notes) + ")"
    return TestResult(passed=passed, total=total, status=status, detail=detail, output=text)
