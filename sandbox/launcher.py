"""The launcher: the first process of a sandboxed run, executed as a script in a fresh
``python -I -S -B -c <this file's text> <config JSON>`` (see :mod:`sandbox.run`).

It runs as the trainer's user (root in the strongest mode), sets up the isolation layers the
config names (namespaces, private mounts, rlimits, niceness, a pid 1 that reaps orphans), drops
privileges and ``exec``s the runner (:mod:`sandbox.runner`, whose source text is in the config).
A separate interpreter rather than a ``preexec_fn``, because ``preexec_fn`` is unsafe in a
threaded parent (the trainer is threaded).

The result pipe arrives as the file descriptor ``config["result_fd"]`` and is moved to fd 3. A
set-up failure is reported there as one ``LAUNCH_ERROR <step>: <error>`` line, before the runner
writes anything. Standard library only: the interpreter runs with ``-S``.
"""

import json
import os
import re
import resource
import sys
from typing import Any, Callable

LINUX = sys.platform.startswith("linux")
RESULT_FD = 3

# Linux constants (linux/sched.h, linux/mount.h, linux/prctl.h)
CLONE_NEWNS, CLONE_NEWIPC, CLONE_NEWUSER = 0x00020000, 0x08000000, 0x10000000
CLONE_NEWPID, CLONE_NEWNET = 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT = 1, 2, 4, 8, 32
MS_NOATIME, MS_NODIRATIME, MS_BIND, MS_REC = 1024, 2048, 4096, 16384
MS_PRIVATE, MS_RELATIME, MS_STRICTATIME = 1 << 18, 1 << 21, 1 << 24
PR_SET_PDEATHSIG, PR_SET_NO_NEW_PRIVS = 1, 38

Mount = Callable[..., None]


def fail(step: str, exc: BaseException) -> None:
    os.write(RESULT_FD, f"LAUNCH_ERROR {step}: {exc}\n".encode("ascii", "replace"))
    os._exit(125)


class Libc:
    """The few libc calls the standard library does not wrap (Linux)."""

    def __init__(self) -> None:
        import ctypes

        self.ctypes = ctypes
        self.lib = ctypes.CDLL(None, use_errno=True)
        self.lib.mount.argtypes = [ctypes.c_char_p] * 3 + [ctypes.c_ulong, ctypes.c_char_p]

    def check(self, rc: int, what: str) -> None:
        if rc != 0:
            err = self.ctypes.get_errno()
            raise OSError(err, f"{what}: {os.strerror(err)}")

    def mount(
        self, src: str | None, dst: str, fstype: str | None, flags: int, data: str | None = None
    ) -> None:
        def enc(s: str | None) -> bytes | None:
            return None if s is None else s.encode()

        rc = self.lib.mount(enc(src), enc(dst), enc(fstype), flags, enc(data))
        self.check(rc, "mount " + dst)

    def unshare(self, flags: int) -> None:
        self.check(self.lib.unshare(flags), "unshare")

    def prctl(self, option: int, arg: int, what: str) -> None:
        self.check(self.lib.prctl(option, arg, 0, 0, 0), what)

    def die_with_parent(self) -> None:
        """SIGKILL when the parent dies; cleared by fork and by setuid, so set again after."""
        self.prctl(PR_SET_PDEATHSIG, 9, "PR_SET_PDEATHSIG")


def main(cfg: dict[str, Any]) -> None:
    step = "start"
    try:
        libc = Libc() if LINUX else None
        flags = 0
        if cfg["network_namespace"]:
            flags |= CLONE_NEWNET
            if not cfg["separate_uid"]:
                flags |= CLONE_NEWUSER  # lets a non-root user own a network namespace
        if cfg["private_mounts"]:
            flags |= CLONE_NEWNS | CLONE_NEWIPC
        if cfg["pid_namespace"]:
            flags |= CLONE_NEWPID  # our next child is pid 1 of a new namespace
        if flags:
            step = "unshare"
            assert libc is not None  # the namespace layers are only chosen on Linux
            libc.unshare(flags)
        if cfg["private_mounts"]:
            step = "private mounts"
            assert libc is not None
            private_mounts(cfg, libc.mount)
        workdir = cfg["workdir"]
        if cfg["private_mounts"]:
            os.makedirs(workdir, mode=0o700)
        if cfg["separate_uid"]:
            os.chown(workdir, cfg["uid"], cfg["uid"])
        os.chdir(workdir)
        step = "rlimits"
        set_rlimits(cfg["rlimits"])
        os.nice(cfg["niceness"])
        if cfg["pid_namespace"]:
            step = "pid namespace"
            assert libc is not None
            libc.die_with_parent()
            init = os.fork()
            if init:
                # The launcher (still root, outside the namespace the candidate can see) waits
                # and passes the status on; when init exits the kernel kills the namespace.
                os._exit(exit_code(os.waitpid(init, 0)[1]))
            libc.mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC | MS_RDONLY)
        if cfg["separate_uid"]:
            step = "drop privileges"
            os.setgroups([])
            os.setgid(cfg["uid"])
            os.setuid(cfg["uid"])
        if libc is not None:
            step = "prctl"
            libc.prctl(PR_SET_NO_NEW_PRIVS, 1, "PR_SET_NO_NEW_PRIVS")
            libc.die_with_parent()
        if cfg["pid_namespace"]:
            step = "init"
            runner = os.fork()
            if runner:
                run_init(runner)
            assert libc is not None
            libc.die_with_parent()
        step = "exec"
        interp = cfg["interpreter"]
        hook = str(int(cfg["audit_hook"]))
        argv = [interp, "-I", "-S", "-B", "-c", cfg["runner"], str(RESULT_FD), hook, workdir]
        os.execve(interp, argv, cfg["env"])
    except (OSError, ValueError) as exc:
        fail(step, exc)


def set_rlimits(rlimits: dict[str, list[int]]) -> None:
    for name, (soft, hard) in rlimits.items():
        res = getattr(resource, name, None)
        if res is None:
            if LINUX:
                raise ValueError(f"resource.{name} is missing")
            continue
        cur_hard = resource.getrlimit(res)[1]
        if cur_hard != resource.RLIM_INFINITY:
            soft, hard = min(soft, cur_hard), min(hard, cur_hard)
        try:
            resource.setrlimit(res, (soft, hard))
        except (ValueError, OSError):
            if LINUX:
                raise


def exit_code(status: int) -> int:
    """A wait status as an exit code; death by signal N becomes 128 + N."""
    code = os.waitstatus_to_exitcode(status)
    return 128 - code if code < 0 else code


def run_init(runner: int) -> None:
    """Pid 1 of the sandbox: reap every orphan; exit with the runner's status, which makes the
    kernel kill and reap whatever is left in the namespace."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_DFL)  # pid 1 ignores default-action signals
    os.close(RESULT_FD)
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


def private_mounts(cfg: dict[str, Any], mount: Mount) -> None:
    """Every host mount read-only (keeping its nosuid/nodev/noexec/atime flags); /tmp, /var/tmp
    and /dev/shm one private tmpfs of ``disk_mb``; the interpreter's prefix reachable."""
    keep = {
        "nosuid": MS_NOSUID,
        "nodev": MS_NODEV,
        "noexec": MS_NOEXEC,
        "noatime": MS_NOATIME,
        "nodiratime": MS_NODIRATIME,
        "relatime": MS_RELATIME,
        "strictatime": MS_STRICTATIME,
    }
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
        point = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), fields[4])
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
        assert prefix_fd is not None
        mount("tmpfs", hidden, "tmpfs", MS_NOSUID | MS_NODEV, "size=64k,nr_inodes=64,mode=755")
        os.makedirs(prefix, mode=0o755)
        mount(f"/proc/self/fd/{prefix_fd}", prefix, None, MS_BIND | MS_REC)
        mount(None, prefix, None, MS_REMOUNT | MS_BIND | MS_RDONLY)
        mount(None, hidden, None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)
        os.close(prefix_fd)


def start() -> None:
    cfg = json.loads(sys.argv[1])
    if cfg["result_fd"] != RESULT_FD:
        os.dup2(cfg["result_fd"], RESULT_FD)
        os.close(cfg["result_fd"])
    main(cfg)


if __name__ == "__main__":
    start()
