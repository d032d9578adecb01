"""What a sandboxed run is allowed (:class:`SandboxLimits`), which isolation layers it uses
(:class:`Isolation`), and what it returns (:class:`TestResult`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Status = Literal["ok", "error", "timeout", "crashed"]
IsolationLevel = Literal["strong", "weak"]


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
        max_output_bytes: stdout+stderr bytes kept; the next 32 MiB are read and dropped, and
            past those the pipe is throttled (:data:`sandbox.run.THROTTLED_READ_INTERVAL_S`): a
            flood waits on its full pipe instead of costing the trainer CPU.
        niceness: added scheduling niceness, so that scoring yields the CPU to training.
        isolation: ``"strong"`` (default) runs only where the kernel gives the candidate an
            allowlisted root in its own mount, PID, IPC and network namespaces (Linux, as root or
            with user namespaces), and raises otherwise; ``"weak"`` also runs without them
            (macOS, user namespaces disabled), after a warning of what is then not protected
            (see docs/reliability.md, "The code sandbox: modes and guarantees").
    """

    timeout_s: float = 5.0
    cpu_time_s: int = 5
    memory_mb: int = 512
    max_processes: int = 8
    max_file_size_mb: int = 1
    max_disk_mb: int = 16
    max_output_bytes: int = 64_000
    niceness: int = 10
    isolation: IsolationLevel = "strong"

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
            (self.isolation in ("strong", "weak"), "isolation", '"strong" or "weak"'),
        ]
        for ok, name, rule in checks:
            if not ok:
                raise ValueError(
                    f"SandboxLimits.{name} must be {rule}, got {getattr(self, name)!r}"
                )


@dataclass(frozen=True)
class Isolation:
    """Which isolation layers a run uses (see :mod:`sandbox` and docs/reliability.md for what
    each one stops).

    Attributes:
        separate_uid: run as a fresh unprivileged uid/gid (needs root); NPROC then counts only
            the run's own processes, the trainer cannot be signalled, and every leftover
            process is found by its uid.
        network_namespace: an empty network namespace (Linux).
        private_mounts: a mount namespace whose root is built from an allowlist (the
            interpreter's prefix and shared libraries read-only, a private tmpfs of
            ``max_disk_mb`` at /tmp, /var/tmp and /dev/shm, a minimal /dev, a private /proc),
            plus a private IPC namespace (Linux; needs ``separate_uid`` or ``user_namespace``).
        pid_namespace: a PID namespace whose pid 1 reaps orphans; the candidate sees none of
            the host's processes, and when it ends the kernel kills everything it started, even
            if the trainer itself was killed (needs ``private_mounts``).
        audit_hook: in-interpreter blocks (PEP 578) on sockets, fork/exec, ctypes, signals to
            other processes and writes outside the working directory; a best-effort layer, not
            a boundary.
        user_namespace: the namespaces above are owned by a fresh user namespace, in which the
            candidate is an unprivileged uid (Linux without root or CAP_SYS_ADMIN).
        seccomp: a seccomp allowlist (:mod:`sandbox.seccomp`): what CPython and the runner need; no signals to other
            processes (by kill or through a file's owner), ptrace, other processes' memory,
            keyrings, namespaces, SysV IPC, sockets, mounts, AIO, io_uring, memfd, file locks,
            nor any call it does not name (a future kernel's); without a PID namespace, no new
            processes either (Linux).
        landlock: Landlock denies writes outside the run's directory; without
            ``private_mounts`` it also denies reads outside the interpreter's prefix and shared
            libraries (Linux 5.13+); where the kernel has scopes (6.12+), signals and abstract
            Unix sockets outside the run too.
    """

    separate_uid: bool
    network_namespace: bool
    private_mounts: bool
    pid_namespace: bool
    audit_hook: bool
    user_namespace: bool = False
    seccomp: bool = False
    landlock: bool = False

    def __post_init__(self) -> None:
        owner = self.separate_uid or self.user_namespace
        if self.private_mounts and not owner:
            raise ValueError(
                "Isolation.private_mounts needs separate_uid=True or user_namespace=True: a "
                "process that keeps root could remount the file system writable"
            )
        if self.network_namespace and not owner:
            raise ValueError(
                "Isolation.network_namespace needs separate_uid=True (root) or "
                "user_namespace=True (which lets a user own a network namespace)"
            )
        if self.pid_namespace and not self.private_mounts:
            raise ValueError(
                "Isolation.pid_namespace needs private_mounts=True (to mount its own /proc)"
            )

    @property
    def strong(self) -> bool:
        """The kernel layers that make the sandbox a boundary are all on (see
        :attr:`SandboxLimits.isolation`)."""
        return self.private_mounts and self.pid_namespace and self.network_namespace

    def describe(self) -> str:
        """One line naming the active layers, for logs."""
        names = [
            ("separate_uid", self.separate_uid),
            ("user_namespace", self.user_namespace),
            ("network_namespace", self.network_namespace),
            ("private_mounts", self.private_mounts),
            ("pid_namespace", self.pid_namespace),
            ("seccomp", self.seccomp),
            ("landlock", self.landlock),
            ("audit_hook", self.audit_hook),
        ]
        return "rlimits, process group, " + ", ".join(n for n, on in names if on)


def rlimits(limits: SandboxLimits, isolation: Isolation) -> dict[str, tuple[int, int]]:
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


@dataclass
class TestResult:
    """Outcome of one sandboxed run.

    Attributes:
        passed: tests whose every check held, judged in the trusted process.
        total: tests given.
        status: ``"ok"`` every test ran; ``"error"`` the candidate's top-level code raised
            (including SyntaxError and ``sys.exit``), so no test ran; ``"timeout"`` the wall-clock
            limit expired; ``"crashed"`` the process ended before reporting every test (``os._exit``,
            a signal, a resource limit). Tests that reported a passing value before a timeout or a
            crash still count.
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
