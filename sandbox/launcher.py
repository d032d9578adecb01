"""The launcher: the first process of a sandboxed run, executed as a script in a fresh
``python -I -S -B -c <this file's text> <config JSON>`` (see :mod:`sandbox.run`).

It runs as the trainer's user (root in the strongest mode), sets up the isolation layers the
config names (namespaces, an allowlisted root file system, rlimits, niceness, a pid 1 that reaps
orphans), drops privileges, restricts itself with Landlock and a seccomp filter, and ``exec``s the
runner (:mod:`sandbox.runner`, whose source text is in the config).
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
import signal
import sys
from typing import Any, Callable

LINUX = sys.platform.startswith("linux")
RESULT_FD = 3

# Linux constants (linux/sched.h, linux/mount.h, linux/prctl.h)
CLONE_NEWNS, CLONE_NEWIPC, CLONE_NEWUSER = 0x00020000, 0x08000000, 0x10000000
CLONE_NEWPID, CLONE_NEWNET = 0x20000000, 0x40000000
CLONE_NEWCGROUP, CLONE_NEWUTS, CLONE_NEWTIME, CLONE_THREAD = 0x02000000, 0x04000000, 0x80, 0x10000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT = 1, 2, 4, 8, 32
MS_NOATIME, MS_NODIRATIME, MS_BIND, MS_REC = 1024, 2048, 4096, 16384
MS_PRIVATE, MS_RELATIME, MS_STRICTATIME = 1 << 18, 1 << 21, 1 << 24
MNT_DETACH = 2
PR_SET_PDEATHSIG, PR_SET_NO_NEW_PRIVS, PR_SET_SECCOMP = 1, 38, 22
#: The candidate's uid inside a user namespace (any non-zero id: it keeps no capability at exec).
INNER_ID = 1000
#: Device nodes of the candidate's /dev (bound from the host's).
DEVICES = ("null", "zero", "full", "random", "urandom")

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

    def umount(self, target: str, flags: int) -> None:
        self.check(self.lib.umount2(target.encode(), flags), "umount " + target)

    def syscall(self, name: str, *args: Any) -> int:
        """A raw system call, by name (:data:`SYSCALLS` of this machine's architecture)."""
        rc = self.lib.syscall(syscall_table()[name], *args)
        if rc < 0:
            err = self.ctypes.get_errno()
            raise OSError(err, f"{name}: {os.strerror(err)}")
        return int(rc)

    def load_seccomp(self, program: bytes) -> None:
        """Install a seccomp BPF filter on this thread (inherited by exec and every child)."""
        import ctypes

        class Fprog(ctypes.Structure):  # struct sock_fprog
            _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_char_p)]

        fprog = Fprog(len(program) // 8, program)
        rc = self.lib.prctl(PR_SET_SECCOMP, 2, ctypes.byref(fprog), 0, 0)  # SECCOMP_MODE_FILTER
        self.check(rc, "PR_SET_SECCOMP")

    def prctl(self, option: int, arg: int, what: str) -> None:
        self.check(self.lib.prctl(option, arg, 0, 0, 0), what)

    def drop_capabilities(self) -> None:
        """Empty this process's effective, permitted and inheritable capability sets (capset,
        version 3); with no_new_privs and a non-zero uid nothing gives them back."""
        ct = self.ctypes
        header = (ct.c_uint32 * 2)(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3, this process
        data = (ct.c_uint32 * 6)()  # two struct __user_cap_data_struct, all zero
        self.check(self.lib.capset(header, data), "capset")

    def die_with_parent(self) -> None:
        """SIGKILL when the parent dies; cleared by fork and by setuid, so set again after."""
        self.prctl(PR_SET_PDEATHSIG, 9, "PR_SET_PDEATHSIG")


def main(cfg: dict[str, Any]) -> None:
    step = "start"
    try:
        libc = Libc() if LINUX else None
        if cfg["separate_uid"] and cfg["user_namespace"]:
            # Root without CAP_SYS_ADMIN: become the fresh uid first, so that it owns the user
            # namespace (RLIMIT_NPROC then counts its processes; root's are never counted).
            step = "drop privileges"
            assert libc is not None
            drop_privileges(cfg["uid"])
            libc.prctl(4, 1, "PR_SET_DUMPABLE")  # setuid cleared it: /proc/self was root's
        outer_uid, outer_gid = os.getuid(), os.getgid()  # unmapped once the user namespace exists
        flags = namespace_flags(cfg)
        if flags:
            step = "unshare"
            assert libc is not None  # the namespace layers are only chosen on Linux
            libc.unshare(flags)
        if cfg["user_namespace"]:
            step = "user namespace ids"
            map_ids(outer_uid, outer_gid)
        if cfg["private_mounts"]:
            step = "allowlisted root"
            sources = open_sources(cfg["read_paths"])
        if cfg["pid_namespace"]:
            step = "pid namespace"
            assert libc is not None
            become_pid_one(libc)
        workdir = cfg["workdir"]
        if cfg["private_mounts"]:
            step = "ipc limits"
            no_shared_memory()  # through the host's /proc, which shows our IPC namespace
            step = "allowlisted root"
            assert libc is not None
            build_root(cfg, sources, libc)
            os.makedirs(workdir, mode=0o700)
        late_drop = cfg["separate_uid"] and not cfg["user_namespace"]
        if late_drop:
            os.chown(workdir, cfg["uid"], cfg["uid"])
        os.chdir(workdir)
        step = "rlimits"
        set_rlimits(cfg["rlimits"])
        os.nice(cfg["niceness"])
        if late_drop:
            step = "drop privileges"
            drop_privileges(cfg["uid"])
        if libc is not None:
            step = "prctl"
            libc.prctl(PR_SET_NO_NEW_PRIVS, 1, "PR_SET_NO_NEW_PRIVS")
            libc.die_with_parent()
        if cfg["user_namespace"]:
            step = "capabilities"
            assert libc is not None
            libc.drop_capabilities()  # pid 1 never execs: it would keep them in the namespace
        # Landlock's rules and the seccomp program are prepared once; pid 1 and the runner each
        # restrict themselves with them after the fork (pid 1 runs under them too). Restricting
        # before the fork cost every run several ms of CPU more.
        ruleset, program = -1, b""
        if cfg["landlock"]:
            step = "landlock"
            assert libc is not None
            ruleset = landlock_ruleset(libc, cfg)
        if cfg["seccomp"]:
            program = with_own_pid(bytes.fromhex(cfg["seccomp_program"]), os.getpid())
        if cfg["pid_namespace"]:
            step = "init"
            assert libc is not None
            # Non-dumpable from before the fork: the candidate (the same uid, once pid 1 dropped
            # its capabilities) never reads or writes pid 1's memory; exec resets the runner's.
            libc.prctl(4, 0, "PR_SET_DUMPABLE")
            runner = os.fork()
            if runner:
                run_init(runner, libc, ruleset, program)
            libc.die_with_parent()
        if libc is not None:
            step = "landlock and seccomp"
            confine(libc, ruleset, program)
        step = "exec"
        interp = cfg["interpreter"]
        hook = str(int(cfg["audit_hook"]))
        argv = [interp, "-I", "-S", "-B", "-c", cfg["runner"], str(RESULT_FD), hook, workdir]
        os.execve(interp, argv, cfg["env"])
    except (OSError, ValueError) as exc:
        fail(step, exc)


def namespace_flags(cfg: dict[str, Any]) -> int:
    """The ``unshare`` flags of the namespaces ``cfg`` asks for (0: none)."""
    flags = 0
    if cfg["user_namespace"]:
        flags |= CLONE_NEWUSER  # lets a user without CAP_SYS_ADMIN own the namespaces below
    if cfg["network_namespace"]:
        flags |= CLONE_NEWNET
    if cfg["private_mounts"]:
        flags |= CLONE_NEWNS | CLONE_NEWIPC
    if cfg["pid_namespace"]:
        flags |= CLONE_NEWPID  # our next child is pid 1 of a new namespace
    return flags


def become_pid_one(libc: Libc) -> None:
    """Fork into the PID namespace ``unshare`` prepared: the launcher outside only waits for
    pid 1 (:func:`wait_for_init` never returns); the child returns as pid 1, in a session of its
    own."""
    libc.die_with_parent()
    # SIGTERM (the trainer's cleanup) waits until the handler that passes it on to
    # pid 1 is in place; pid 1 unblocks it at once.
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    init = os.fork()
    if init:
        # Outside the namespace the launcher only waits: it gives up the result pipe
        # first, so nothing it does later (a late SIGTERM) can write a record.
        os.close(RESULT_FD)
        wait_for_init(init)
    libc.die_with_parent()
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
    # A session and process group of its own: the run's kill(0, ...) and killpg reach
    # only the namespace's processes, never the launcher outside it.
    os.setsid()


def drop_privileges(uid: int) -> None:
    """Become ``uid`` (and gid ``uid``), with no supplementary groups."""
    os.setgroups([])
    os.setgid(uid)
    os.setuid(uid)


def map_ids(outer_uid: int, outer_gid: int) -> None:
    """In a fresh user namespace: the trainer's uid and gid become ``INNER_ID``, the only ids
    mapped (the kernel lets a process map its own ids without privilege)."""
    with open("/proc/self/setgroups", "w") as f:
        f.write("deny")
    with open("/proc/self/uid_map", "w") as f:
        f.write(f"{INNER_ID} {outer_uid} 1")
    with open("/proc/self/gid_map", "w") as f:
        f.write(f"{INNER_ID} {outer_gid} 1")


def wait_for_init(init: int) -> None:
    """The launcher, outside the PID namespace: wait for its pid 1 and pass its status on. On
    SIGTERM (the trainer's cleanup) kill pid 1 first, which makes the kernel kill every process
    of the namespace before pid 1's exit is reported: when the launcher exits, none is left."""

    try:
        target = os.pidfd_open(init)  # a pidfd never names a recycled pid
    except (OSError, AttributeError):  # kernels before 5.3
        target = -1
    signal.signal(signal.SIGTERM, lambda _signum, _frame: kill_quietly(init, target))
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
    status = os.waitpid(init, 0)[1]
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})  # pid 1 is reaped: nothing to kill
    os._exit(exit_code(status))


def kill_quietly(pid: int, pidfd: int = -1) -> None:
    """SIGKILL ``pid`` (through ``pidfd`` when there is one), a child of ours; one already reaped
    (the SIGTERM came between ``waitpid`` and ``_exit``) is fine. That race once raised here and
    wrote a stray LAUNCH_ERROR line after the runner's records."""
    try:
        if pidfd >= 0:
            signal.pidfd_send_signal(pidfd, signal.SIGKILL)
        else:
            os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


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


def confine(libc: Libc, ruleset: int, program: bytes) -> None:
    """Restrict this process with the Landlock ``ruleset`` (a descriptor, closed here; -1 for
    none) and the seccomp ``program`` (empty for none)."""
    if ruleset >= 0:
        libc.syscall("landlock_restrict_self", ruleset, 0)
        os.close(ruleset)
    if program:
        libc.load_seccomp(program)


def run_init(runner: int, libc: Libc, ruleset: int, program: bytes) -> None:
    """Pid 1 of the sandbox: reap every orphan; exit with the runner's status, which makes the
    kernel kill and reap whatever is left in the namespace. It restricts itself at once with the
    runner's Landlock rules and seccomp filter (if that fails here, the runner is killed before
    it could report; it held for the runner's probe on this kernel)."""
    try:
        confine(libc, ruleset, program)
    except OSError:
        os.kill(runner, signal.SIGKILL)
        raise
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


def open_sources(paths: list[str]) -> dict[str, tuple[str, Any]]:
    """Each path of the allowlist as ``("link", target)`` or ``("bind", O_PATH fd)``, opened in
    the new mount namespace before the new root's tmpfs covers /tmp (which may hold some of
    them); missing (or unreachable) paths are left out."""
    sources: dict[str, tuple[str, Any]] = {}
    for path in paths:
        if os.path.islink(path):
            sources[path] = ("link", os.readlink(path))
        elif os.path.exists(path):
            sources[path] = ("bind", os.open(path, os.O_PATH | os.O_CLOEXEC))
    return sources


def build_root(cfg: dict[str, Any], sources: dict[str, tuple[str, Any]], libc: Libc) -> None:
    """Make the candidate's root file system from an allowlist, and switch to it.

    A fresh tmpfs becomes ``/``, holding only: ``cfg["read_paths"]`` (the interpreter's prefix
    and the shared-library directories) bound read-only at their own paths (a symbolic link,
    such as Debian's ``/lib -> usr/lib``, is recreated as a link); a writable tmpfs of
    ``disk_mb`` at ``/tmp``, also seen at ``/var/tmp`` and ``/dev/shm``; a ``/dev`` of
    :data:`DEVICES` bound from the host; and, in a PID namespace, a fresh ``/proc``. The host's
    root is then detached: no repository, home directory, ``/etc``, ``/run``, ``/sys``, host
    ``/tmp`` or socket is reachable by any path. Then ``/`` is made read-only.
    """
    mount = libc.mount
    mount(None, "/", None, MS_REC | MS_PRIVATE)
    devices = {d: os.open(f"/dev/{d}", os.O_PATH | os.O_CLOEXEC) for d in DEVICES}
    root = "/tmp"
    mount("tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,nr_inodes=1024,mode=755")
    bound: list[str] = []
    for path in sorted(sources):
        if any(path == b or path.startswith(b + "/") for b in bound):
            continue  # inside a directory already bound
        kind, value = sources[path]
        target = root + path
        os.makedirs(os.path.dirname(target), mode=0o755, exist_ok=True)
        if kind == "link":
            os.symlink(value, target)
            continue
        bind_read_only(libc, value, target)
        bound.append(path)
    os.makedirs(root + "/tmp", mode=0o755)
    size = cfg["disk_mb"]
    flags = MS_NOSUID | MS_NODEV
    mount("tmpfs", root + "/tmp", "tmpfs", flags, f"size={size}m,nr_inodes=4096,mode=1777")
    os.makedirs(root + "/dev/shm", mode=0o755)
    os.makedirs(root + "/var/tmp", mode=0o755)
    for other in ("/dev/shm", "/var/tmp"):
        mount(root + "/tmp", root + other, None, MS_BIND)
    for name, fd in devices.items():
        os.close(os.open(root + "/dev/" + name, os.O_CREAT | os.O_WRONLY, 0o666))
        mount(f"/proc/self/fd/{fd}", root + "/dev/" + name, None, MS_BIND)
        os.close(fd)
    for name, target in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0")):
        os.symlink(target, root + "/dev/" + name)
    os.symlink("/proc/self/fd/1", root + "/dev/stdout")
    os.symlink("/proc/self/fd/2", root + "/dev/stderr")
    os.makedirs(root + "/proc", mode=0o755)
    if cfg["pid_namespace"]:
        mount("proc", root + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC | MS_RDONLY)
    os.chdir(root)
    libc.syscall("pivot_root", b".", b".")  # the old root now sits on top of the new one
    libc.umount(".", MNT_DETACH)  # and is gone
    os.chdir("/")
    mount(None, "/", None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV)


def bind_read_only(libc: Libc, fd: int, target: str) -> None:
    """Bind the directory or file open as ``fd`` at ``target``, read-only, keeping the flags
    the source mount has (a user namespace may not clear them)."""
    if os.path.isdir(f"/proc/self/fd/{fd}"):
        os.makedirs(target, mode=0o755, exist_ok=True)
    else:
        os.close(os.open(target, os.O_CREAT | os.O_WRONLY, 0o644))
    libc.mount(f"/proc/self/fd/{fd}", target, None, MS_BIND | MS_REC)
    source_flags = os.statvfs(target).f_flag
    keep = 0
    for st, ms in ((2, MS_NOSUID), (4, MS_NODEV), (8, MS_NOEXEC), (1024, MS_NOATIME)):
        keep |= ms if source_flags & st else 0
    keep |= MS_NODIRATIME if source_flags & 2048 else 0
    keep |= MS_RELATIME if source_flags & 4096 else 0
    libc.mount(None, target, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | keep)
    os.close(fd)


def no_shared_memory() -> None:
    """No SysV shared memory in this IPC namespace, where the kernel lets us say so (seccomp
    denies the SysV IPC calls anyway; this is the second line)."""
    for name in ("shmmax", "shmall", "shmmni"):
        try:
            with open(f"/proc/sys/kernel/{name}", "w") as f:
                f.write("0")
        except OSError as exc:
            if exc.errno in (1, 13, 30):  # EPERM, EACCES, EROFS: not ours to set here
                return
            raise


# --------------------------------------------------------------------------- seccomp

#: Numbers of the calls the launcher makes itself without a C library wrapper (linux/unistd.h).
SYSCALLS: dict[str, dict[str, int]] = {
    "x86_64": {
        "pivot_root": 155,
        "landlock_create_ruleset": 444,
        "landlock_add_rule": 445,
        "landlock_restrict_self": 446,
    },
    "aarch64": {
        "pivot_root": 41,
        "landlock_create_ruleset": 444,
        "landlock_add_rule": 445,
        "landlock_restrict_self": 446,
    },
}
#: Stands for the launcher's pid in a seccomp program built by the trainer
#: (:func:`sandbox.seccomp.seccomp_program`); no pid is this large.
OWN_PID_PLACEHOLDER = 0x7FFFFFF0


def machine() -> str:
    return os.uname().machine


def syscall_table() -> dict[str, int]:
    table = SYSCALLS.get(machine())
    if table is None:
        raise ValueError(f"no system call table for the {machine()} architecture")
    return table


def with_own_pid(program: bytes, pid: int) -> bytes:
    """``program`` (``struct sock_filter`` array) with every comparison against
    :data:`OWN_PID_PLACEHOLDER` made against ``pid``."""
    import struct

    out = bytearray(program)
    for offset in range(0, len(out), 8):
        code, jt, jf, k = struct.unpack_from("HBBI", out, offset)
        if code == 0x15 and k == OWN_PID_PLACEHOLDER:  # jeq
            struct.pack_into("HBBI", out, offset, code, jt, jf, pid)
    return bytes(out)


# --------------------------------------------------------------------------- landlock

#: Landlock file-system rights (linux/landlock.h) and the ABI version that added each.
LL_EXECUTE, LL_WRITE_FILE, LL_READ_FILE, LL_READ_DIR = 1, 2, 4, 8
LL_WRITES = 16 | 32 | 64 | 128 | 256 | 512 | 1024 | 2048 | 4096  # remove, make *
LL_REFER, LL_TRUNCATE, LL_IOCTL_DEV = 8192, 16384, 32768
#: Landlock scopes (ABI 6, Linux 6.12): no signal to a process outside the sandbox's domain (the
#: F_SETOWN path included), no connection to an abstract Unix socket made outside it.
LL_SCOPE_ABSTRACT_UNIX_SOCKET, LL_SCOPE_SIGNAL = 1, 2


def landlock_abi(libc: Libc) -> int:
    """The kernel's Landlock ABI version (0 when it has none)."""
    try:
        return libc.syscall("landlock_create_ruleset", None, 0, 1)  # _VERSION
    except OSError:
        return 0


def landlock_ruleset(libc: Libc, cfg: dict[str, Any]) -> int:
    """The Landlock ruleset (a descriptor, for ``landlock_restrict_self``): writes anywhere but
    beneath ``cfg["write_paths"]`` (and to the harmless devices) are denied; with
    ``cfg["landlock_reads"]`` reads are allowed beneath
    ``cfg["read_paths"]`` only (the allowlisted root of the modes without a mount namespace);
    where the kernel has scopes (ABI 6), signals to processes outside the sandbox (the trainer,
    by kill or by F_SETOWN) and abstract Unix sockets made outside it are denied too."""
    import struct

    ct = libc.ctypes
    abi = landlock_abi(libc)
    if abi < 1:
        raise OSError(95, "this kernel has no Landlock")
    writes = LL_WRITE_FILE | LL_WRITES
    writes |= (LL_REFER if abi >= 2 else 0) | (LL_TRUNCATE if abi >= 3 else 0)
    reads = LL_EXECUTE | LL_READ_FILE | LL_READ_DIR
    handled = writes | (reads if cfg["landlock_reads"] else 0)
    attr = struct.pack("Q", handled)
    if abi >= 6:  # scoped (handled_access_net, 0, comes between)
        attr = struct.pack("QQQ", handled, 0, LL_SCOPE_ABSTRACT_UNIX_SOCKET | LL_SCOPE_SIGNAL)
    fd = libc.syscall("landlock_create_ruleset", attr, len(attr), 0)

    def allow(path: str, rights: int) -> None:
        if not os.path.lexists(path):
            return
        target = os.open(path, os.O_PATH | os.O_CLOEXEC)
        if not os.path.isdir(path):
            rights &= LL_EXECUTE | LL_WRITE_FILE | LL_READ_FILE | LL_TRUNCATE
        rule = struct.pack("=Qi", rights & handled, target)
        try:
            libc.syscall("landlock_add_rule", fd, 1, ct.c_char_p(rule), 0)  # PATH_BENEATH
        finally:
            os.close(target)

    if cfg["landlock_reads"]:
        for path in cfg["read_paths"]:
            allow(os.path.realpath(path), reads)
    for path in cfg["write_paths"]:
        allow(path, handled)
    for name in DEVICES:
        allow("/dev/" + name, reads | writes)
    os.set_inheritable(fd, False)
    return fd


def start() -> None:
    cfg = json.loads(sys.argv[1])
    if cfg["result_fd"] != RESULT_FD:
        os.dup2(cfg["result_fd"], RESULT_FD)
        os.close(cfg["result_fd"])
    main(cfg)


if __name__ == "__main__":
    start()
