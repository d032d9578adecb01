"""The seccomp filter of a sandboxed run, built in the trainer and loaded by the launcher
(:mod:`sandbox.launcher`, which puts its own pid in it): an allowlist, deny by default.

The filter allows what CPython's start-up, imports, threads and standard library (files, time,
select/epoll, asyncio's socketpair, sqlite3 in memory, tempfile, shutil) and the runner call,
found by tracing the runner (``strace -f``) over the bundled code tasks and a program using each
of them. A call it does not name answers ENOSYS, as from a kernel without it, so that the C
library's fallbacks run and a call a future kernel adds is denied; a call of :data:`DENIED`
answers EPERM. A call missing here fails with ENOSYS in the candidate, never in the trainer.
Calls that exist on x86-64 only are skipped on arm64.
"""

from __future__ import annotations

import os
import struct

from sandbox.launcher import CLONE_NEWCGROUP, CLONE_NEWIPC, CLONE_NEWNET, CLONE_NEWNS
from sandbox.launcher import CLONE_NEWPID, CLONE_NEWTIME, CLONE_NEWUSER, CLONE_NEWUTS
from sandbox.launcher import CLONE_THREAD

#: System call numbers of every call the filter names, per architecture (linux/unistd.h; the
#: calls added since Linux 5.1 share one number on every architecture).
SYSCALLS: dict[str, dict[str, int]] = {
    "x86_64": {
        "access": 21,
        "add_key": 248,
        "alarm": 37,
        "arch_prctl": 158,
        "bpf": 321,
        "brk": 12,
        "capget": 125,
        "chdir": 80,
        "chmod": 90,
        "chroot": 161,
        "clock_getres": 229,
        "clock_gettime": 228,
        "clock_nanosleep": 230,
        "clone": 56,
        "clone3": 435,
        "close": 3,
        "close_range": 436,
        "copy_file_range": 326,
        "creat": 85,
        "dup": 32,
        "dup2": 33,
        "dup3": 292,
        "epoll_create": 213,
        "epoll_create1": 291,
        "epoll_ctl": 233,
        "epoll_pwait": 281,
        "epoll_pwait2": 441,
        "epoll_wait": 232,
        "eventfd": 284,
        "eventfd2": 290,
        "execve": 59,
        "execveat": 322,
        "exit": 60,
        "exit_group": 231,
        "faccessat": 269,
        "faccessat2": 439,
        "fadvise64": 221,
        "fallocate": 285,
        "fchdir": 81,
        "fchmod": 91,
        "fchmodat": 268,
        "fchmodat2": 452,
        "fcntl": 72,
        "fdatasync": 75,
        "fgetxattr": 193,
        "flistxattr": 196,
        "flock": 73,
        "fork": 57,
        "fsconfig": 431,
        "fsmount": 432,
        "fsopen": 430,
        "fspick": 433,
        "fstat": 5,
        "fstatfs": 138,
        "fsync": 74,
        "ftruncate": 77,
        "futex": 202,
        "futimesat": 261,
        "getcpu": 309,
        "getcwd": 79,
        "getdents": 78,
        "getdents64": 217,
        "getegid": 108,
        "geteuid": 107,
        "getgid": 104,
        "getgroups": 115,
        "getitimer": 36,
        "getpeername": 52,
        "getpgid": 121,
        "getpgrp": 111,
        "getpid": 39,
        "getppid": 110,
        "getpriority": 140,
        "getrandom": 318,
        "getresgid": 120,
        "getresuid": 118,
        "getrlimit": 97,
        "getrusage": 98,
        "getsid": 124,
        "getsockname": 51,
        "getsockopt": 55,
        "gettid": 186,
        "gettimeofday": 96,
        "getuid": 102,
        "getxattr": 191,
        "io_cancel": 210,
        "io_destroy": 207,
        "io_getevents": 208,
        "io_pgetevents": 333,
        "io_setup": 206,
        "io_submit": 209,
        "io_uring_enter": 426,
        "io_uring_register": 427,
        "io_uring_setup": 425,
        "ioctl": 16,
        "kcmp": 312,
        "keyctl": 250,
        "kill": 62,
        "landlock_add_rule": 445,
        "landlock_create_ruleset": 444,
        "landlock_restrict_self": 446,
        "lgetxattr": 192,
        "link": 86,
        "linkat": 265,
        "listxattr": 194,
        "llistxattr": 195,
        "lseek": 8,
        "lstat": 6,
        "madvise": 28,
        "memfd_create": 319,
        "memfd_secret": 447,
        "mincore": 27,
        "mkdir": 83,
        "mkdirat": 258,
        "mknod": 133,
        "mknodat": 259,
        "mmap": 9,
        "mount": 165,
        "mount_setattr": 442,
        "move_mount": 429,
        "mprotect": 10,
        "mremap": 25,
        "msgctl": 71,
        "msgget": 68,
        "msgrcv": 70,
        "msgsnd": 69,
        "msync": 26,
        "munmap": 11,
        "name_to_handle_at": 303,
        "nanosleep": 35,
        "newfstatat": 262,
        "open": 2,
        "open_by_handle_at": 304,
        "open_tree": 428,
        "openat": 257,
        "pause": 34,
        "perf_event_open": 298,
        "pidfd_getfd": 438,
        "pidfd_send_signal": 424,
        "pipe": 22,
        "pipe2": 293,
        "pivot_root": 155,
        "poll": 7,
        "ppoll": 271,
        "prctl": 157,
        "pread64": 17,
        "preadv": 295,
        "preadv2": 327,
        "prlimit64": 302,
        "process_madvise": 440,
        "process_vm_readv": 310,
        "process_vm_writev": 311,
        "pselect6": 270,
        "ptrace": 101,
        "pwrite64": 18,
        "pwritev": 296,
        "pwritev2": 328,
        "read": 0,
        "readlink": 89,
        "readlinkat": 267,
        "readv": 19,
        "recvfrom": 45,
        "recvmmsg": 299,
        "recvmsg": 47,
        "rename": 82,
        "renameat": 264,
        "renameat2": 316,
        "request_key": 249,
        "restart_syscall": 219,
        "rmdir": 84,
        "rseq": 334,
        "rt_sigaction": 13,
        "rt_sigpending": 127,
        "rt_sigprocmask": 14,
        "rt_sigqueueinfo": 129,
        "rt_sigreturn": 15,
        "rt_sigsuspend": 130,
        "rt_sigtimedwait": 128,
        "rt_tgsigqueueinfo": 297,
        "sched_get_priority_max": 146,
        "sched_get_priority_min": 147,
        "sched_getaffinity": 204,
        "sched_getparam": 143,
        "sched_getscheduler": 145,
        "sched_yield": 24,
        "select": 23,
        "semctl": 66,
        "semget": 64,
        "semop": 65,
        "semtimedop": 220,
        "sendfile": 40,
        "sendmmsg": 307,
        "sendmsg": 46,
        "sendto": 44,
        "set_robust_list": 273,
        "set_tid_address": 218,
        "setitimer": 38,
        "setns": 308,
        "setpgid": 109,
        "setpriority": 141,
        "setrlimit": 160,
        "setsid": 112,
        "setsockopt": 54,
        "shmat": 30,
        "shmctl": 31,
        "shmdt": 67,
        "shmget": 29,
        "shutdown": 48,
        "sigaltstack": 131,
        "signalfd": 282,
        "signalfd4": 289,
        "socket": 41,
        "socketpair": 53,
        "splice": 275,
        "stat": 4,
        "statfs": 137,
        "statx": 332,
        "symlink": 88,
        "symlinkat": 266,
        "sysinfo": 99,
        "tgkill": 234,
        "time": 201,
        "timer_create": 222,
        "timer_delete": 226,
        "timer_getoverrun": 225,
        "timer_gettime": 224,
        "timer_settime": 223,
        "timerfd_create": 283,
        "timerfd_gettime": 287,
        "timerfd_settime": 286,
        "times": 100,
        "tkill": 200,
        "truncate": 76,
        "umask": 95,
        "umount2": 166,
        "uname": 63,
        "unlink": 87,
        "unlinkat": 263,
        "unshare": 272,
        "userfaultfd": 323,
        "utime": 132,
        "utimensat": 280,
        "utimes": 235,
        "vfork": 58,
        "wait4": 61,
        "waitid": 247,
        "write": 1,
        "writev": 20,
    },
    "aarch64": {
        "add_key": 217,
        "bpf": 280,
        "brk": 214,
        "capget": 90,
        "chdir": 49,
        "chroot": 51,
        "clock_getres": 114,
        "clock_gettime": 113,
        "clock_nanosleep": 115,
        "clone": 220,
        "clone3": 435,
        "close": 57,
        "close_range": 436,
        "copy_file_range": 285,
        "dup": 23,
        "dup3": 24,
        "epoll_create1": 20,
        "epoll_ctl": 21,
        "epoll_pwait": 22,
        "epoll_pwait2": 441,
        "eventfd2": 19,
        "execve": 221,
        "execveat": 281,
        "exit": 93,
        "exit_group": 94,
        "faccessat": 48,
        "faccessat2": 439,
        "fadvise64": 223,
        "fallocate": 47,
        "fchdir": 50,
        "fchmod": 52,
        "fchmodat": 53,
        "fchmodat2": 452,
        "fcntl": 25,
        "fdatasync": 83,
        "fgetxattr": 10,
        "flistxattr": 13,
        "flock": 32,
        "fsconfig": 431,
        "fsmount": 432,
        "fsopen": 430,
        "fspick": 433,
        "fstat": 80,
        "fstatfs": 44,
        "fsync": 82,
        "ftruncate": 46,
        "futex": 98,
        "getcpu": 168,
        "getcwd": 17,
        "getdents64": 61,
        "getegid": 177,
        "geteuid": 175,
        "getgid": 176,
        "getgroups": 158,
        "getitimer": 102,
        "getpeername": 205,
        "getpgid": 155,
        "getpid": 172,
        "getppid": 173,
        "getpriority": 141,
        "getrandom": 278,
        "getresgid": 150,
        "getresuid": 148,
        "getrlimit": 163,
        "getrusage": 165,
        "getsid": 156,
        "getsockname": 204,
        "getsockopt": 209,
        "gettid": 178,
        "gettimeofday": 169,
        "getuid": 174,
        "getxattr": 8,
        "io_cancel": 3,
        "io_destroy": 1,
        "io_getevents": 4,
        "io_pgetevents": 292,
        "io_setup": 0,
        "io_submit": 2,
        "io_uring_enter": 426,
        "io_uring_register": 427,
        "io_uring_setup": 425,
        "ioctl": 29,
        "kcmp": 272,
        "keyctl": 219,
        "kill": 129,
        "landlock_add_rule": 445,
        "landlock_create_ruleset": 444,
        "landlock_restrict_self": 446,
        "lgetxattr": 9,
        "linkat": 37,
        "listxattr": 11,
        "llistxattr": 12,
        "lseek": 62,
        "madvise": 233,
        "memfd_create": 279,
        "memfd_secret": 447,
        "mincore": 232,
        "mkdirat": 34,
        "mknodat": 33,
        "mmap": 222,
        "mount": 40,
        "mount_setattr": 442,
        "move_mount": 429,
        "mprotect": 226,
        "mremap": 216,
        "msgctl": 187,
        "msgget": 186,
        "msgrcv": 188,
        "msgsnd": 189,
        "msync": 227,
        "munmap": 215,
        "name_to_handle_at": 264,
        "nanosleep": 101,
        "newfstatat": 79,
        "open_by_handle_at": 265,
        "open_tree": 428,
        "openat": 56,
        "perf_event_open": 241,
        "pidfd_getfd": 438,
        "pidfd_send_signal": 424,
        "pipe2": 59,
        "pivot_root": 41,
        "ppoll": 73,
        "prctl": 167,
        "pread64": 67,
        "preadv": 69,
        "preadv2": 286,
        "prlimit64": 261,
        "process_madvise": 440,
        "process_vm_readv": 270,
        "process_vm_writev": 271,
        "pselect6": 72,
        "ptrace": 117,
        "pwrite64": 68,
        "pwritev": 70,
        "pwritev2": 287,
        "read": 63,
        "readlinkat": 78,
        "readv": 65,
        "recvfrom": 207,
        "recvmmsg": 243,
        "recvmsg": 212,
        "renameat": 38,
        "renameat2": 276,
        "request_key": 218,
        "restart_syscall": 128,
        "rseq": 293,
        "rt_sigaction": 134,
        "rt_sigpending": 136,
        "rt_sigprocmask": 135,
        "rt_sigqueueinfo": 138,
        "rt_sigreturn": 139,
        "rt_sigsuspend": 133,
        "rt_sigtimedwait": 137,
        "rt_tgsigqueueinfo": 240,
        "sched_get_priority_max": 125,
        "sched_get_priority_min": 126,
        "sched_getaffinity": 123,
        "sched_getparam": 121,
        "sched_getscheduler": 120,
        "sched_yield": 124,
        "semctl": 191,
        "semget": 190,
        "semop": 193,
        "semtimedop": 192,
        "sendfile": 71,
        "sendmmsg": 269,
        "sendmsg": 211,
        "sendto": 206,
        "set_robust_list": 99,
        "set_tid_address": 96,
        "setitimer": 103,
        "setns": 268,
        "setpgid": 154,
        "setpriority": 140,
        "setrlimit": 164,
        "setsid": 157,
        "setsockopt": 208,
        "shmat": 196,
        "shmctl": 195,
        "shmdt": 197,
        "shmget": 194,
        "shutdown": 210,
        "sigaltstack": 132,
        "signalfd4": 74,
        "socket": 198,
        "socketpair": 199,
        "splice": 76,
        "statfs": 43,
        "statx": 291,
        "symlinkat": 36,
        "sysinfo": 179,
        "tgkill": 131,
        "timer_create": 107,
        "timer_delete": 111,
        "timer_getoverrun": 109,
        "timer_gettime": 108,
        "timer_settime": 110,
        "timerfd_create": 85,
        "timerfd_gettime": 87,
        "timerfd_settime": 86,
        "times": 153,
        "tkill": 130,
        "truncate": 45,
        "umask": 166,
        "umount2": 39,
        "uname": 160,
        "unlinkat": 35,
        "unshare": 97,
        "userfaultfd": 282,
        "utimensat": 88,
        "wait4": 260,
        "waitid": 95,
        "write": 64,
        "writev": 66,
    },
}
#: AUDIT_ARCH_* of each architecture (linux/audit.h), checked first by the filter.
AUDIT_ARCH = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}

#: Allowed outright, the most frequent first (the filter tests them in this order).
ALLOWED = (
    # reading, writing and memory
    "read", "write", "close", "fstat", "newfstatat", "lseek", "mmap", "munmap", "mprotect",
    "brk", "openat", "open", "futex", "rt_sigaction", "rt_sigprocmask", "rt_sigreturn",
    "getpid", "gettid", "getdents64", "getdents", "pread64", "pwrite64", "readv", "writev",
    "preadv", "pwritev", "preadv2", "pwritev2", "mremap", "madvise", "msync", "mincore",
    # files, beneath what Landlock and the mounts let it reach
    "stat", "lstat", "statx", "access", "faccessat", "faccessat2", "readlink", "readlinkat",
    "getcwd", "chdir", "fchdir", "mkdir", "mkdirat", "rmdir", "unlink", "unlinkat", "rename",
    "renameat", "renameat2", "link", "linkat", "symlink", "symlinkat", "chmod", "fchmod",
    "fchmodat", "fchmodat2", "truncate", "ftruncate", "fsync", "fdatasync", "utimensat",
    "utime", "utimes", "futimesat", "fallocate", "fadvise64", "sendfile", "copy_file_range",
    "splice", "statfs", "fstatfs", "umask", "creat", "getxattr", "lgetxattr", "fgetxattr",
    "listxattr", "llistxattr", "flistxattr",
    # descriptors, waiting, timers
    "close_range", "dup", "dup2", "dup3", "pipe", "pipe2", "select", "pselect6", "poll",
    "ppoll", "epoll_create", "epoll_create1", "epoll_ctl", "epoll_wait", "epoll_pwait",
    "epoll_pwait2", "eventfd", "eventfd2", "timerfd_create", "timerfd_settime",
    "timerfd_gettime", "signalfd", "signalfd4",
    # a connected pair of sockets (socket() itself is denied), and its I/O
    "socketpair", "sendto", "recvfrom", "sendmsg", "recvmsg", "sendmmsg", "recvmmsg",
    "shutdown", "getsockopt", "setsockopt", "getsockname", "getpeername",
    # its own identity, processes, threads
    "getppid", "getuid", "geteuid", "getgid", "getegid", "getresuid", "getresgid", "getgroups",
    "getpgrp", "getpgid", "getsid", "setsid", "setpgid", "capget", "execve", "execveat",
    "wait4", "waitid", "exit", "exit_group", "set_robust_list", "set_tid_address", "rseq",
    "arch_prctl", "prctl", "sched_yield", "sched_getaffinity", "sched_getparam",
    "sched_getscheduler", "sched_get_priority_max", "sched_get_priority_min", "getcpu",
    # signals to itself, time, limits
    "rt_sigsuspend", "rt_sigpending", "rt_sigtimedwait", "sigaltstack", "pause", "alarm",
    "setitimer", "getitimer", "timer_create", "timer_settime", "timer_gettime",
    "timer_getoverrun", "timer_delete", "clock_gettime", "clock_getres", "clock_nanosleep",
    "nanosleep", "gettimeofday", "time", "times", "uname", "sysinfo", "getrusage", "getrandom",
    "getrlimit", "setrlimit", "getpriority", "restart_syscall",
)  # fmt: skip
#: Allowed when an argument says so (see :func:`seccomp_program`): signals only to itself (in a
#: PID namespace, to its own processes), no new namespace and (without a PID namespace) no new
#: process, :data:`DENIED_FCNTL` and :data:`ALLOWED_IOCTL`, limits and priority of itself only.
CONDITIONAL = (
    "kill", "tgkill", "rt_sigqueueinfo", "rt_tgsigqueueinfo", "clone", "clone3", "fork",
    "vfork", "fcntl", "ioctl", "prlimit64", "setpriority",
)  # fmt: skip
#: Denied with EPERM (the rest of what the filter does not allow gets ENOSYS): signals by thread
#: id or pidfd, tracing and other processes' memory, the kernel keyring, namespaces, SysV IPC,
#: sockets, mounts and file handles, and the kernel interfaces a Python program has no use for
#: and that take shared kernel resources (BPF, perf, userfaultfd, io_uring and AIO: the host's
#: ``fs.aio-max-nr`` pool; memfd and memfd_secret: memory past RLIMIT_AS; flock: a lock on a
#: file shared read-only with the host blocks host processes and is a channel between runs).
DENIED = (
    "tkill", "pidfd_send_signal", "pidfd_getfd", "ptrace", "process_vm_readv",
    "process_vm_writev", "add_key", "request_key", "keyctl", "unshare", "setns", "shmget",
    "shmat", "shmctl", "shmdt", "msgget", "msgsnd", "msgrcv", "msgctl", "semget", "semop",
    "semctl", "semtimedop", "socket", "mount", "umount2", "pivot_root", "chroot", "bpf",
    "perf_event_open", "userfaultfd", "io_uring_setup", "io_uring_enter", "io_uring_register",
    "io_setup", "io_destroy", "io_submit", "io_cancel", "io_getevents", "io_pgetevents",
    "memfd_create", "memfd_secret", "flock", "open_tree", "move_mount", "fsopen", "fsconfig",
    "fsmount", "fspick", "mount_setattr", "kcmp", "process_madvise", "name_to_handle_at",
    "open_by_handle_at", "landlock_create_ruleset", "landlock_add_rule", "landlock_restrict_self",
)  # fmt: skip
#: fcntl commands denied (EPERM): F_SETOWN, F_SETOWN_EX and F_SETSIG (the kernel would signal
#: the owner it names when the file is ready: the trainer, from the weak mode), and F_SETLK,
#: F_SETLKW, F_OFD_SETLK, F_OFD_SETLKW, F_SETLEASE (locks and leases, as ``flock``).
DENIED_FCNTL = (8, 15, 10, 6, 7, 37, 38, 1024)
#: ioctl commands allowed (asm-generic/ioctls.h, the same numbers on x86-64 and arm64): TCGETS,
#: TIOCGWINSZ, FIONREAD, FIONBIO, FIONCLEX, FIOCLEX (``isatty``, the terminal's size,
#: non-blocking and close-on-exec flags). Every other answers ENOTTY, FIOSETOWN and SIOCSPGRP
#: (the ioctl forms of F_SETOWN) included.
ALLOWED_IOCTL = (0x5401, 0x5413, 0x541B, 0x5421, 0x5450, 0x5451)
NAMESPACE_FLAGS = (
    CLONE_NEWNS
    | CLONE_NEWIPC
    | CLONE_NEWUSER
    | CLONE_NEWPID
    | CLONE_NEWNET
    | CLONE_NEWCGROUP
    | CLONE_NEWUTS
    | CLONE_NEWTIME
)
EPERM, ENOTTY, ENOSYS = 1, 25, 38


def machine() -> str:
    """This machine's architecture, as :data:`SYSCALLS` names it."""
    return os.uname().machine


def syscall_table() -> dict[str, int]:
    """:data:`SYSCALLS` of this machine's architecture."""
    table = SYSCALLS.get(machine())
    if table is None:
        raise ValueError(f"no system call table for the {machine()} architecture")
    return table


def seccomp_program(own_pid: int, pid_namespace: bool) -> bytes:
    """A seccomp BPF program (``struct sock_filter`` array) for this architecture (the trainer
    builds it with :data:`sandbox.launcher.OWN_PID_PLACEHOLDER` for ``own_pid``).

    Kills the process on another architecture's calls (x86's 32-bit ABI, x32); allows
    :data:`ALLOWED`; answers EPERM for :data:`DENIED` and ENOSYS for every other call (a call
    added by a future kernel included). Conditions (:data:`CONDITIONAL`): ``kill`` and
    ``rt_sigqueueinfo`` only to ``own_pid`` or 0 (its process group), ``tgkill`` and
    ``rt_tgsigqueueinfo`` only to ``own_pid``; in a PID namespace (``pid_namespace``, whose pid 1
    starts a session of its own) to any pid or 0, which can only name the run's own processes,
    and never to a negative one. ``clone`` with a namespace flag is denied; without a PID
    namespace to hold new processes, ``clone`` without ``CLONE_THREAD``, ``fork`` and ``vfork``
    are too (threads only). ``clone3`` answers ENOSYS (its flags are out of the filter's reach;
    the C library falls back to ``clone``). ``fcntl`` denies :data:`DENIED_FCNTL`; ``ioctl``
    allows :data:`ALLOWED_IOCTL` only (ENOTTY); ``prlimit64`` acts on itself only (pid 0), and
    ``setpriority`` on itself only (``PRIO_PROCESS``, 0).
    """
    table, arch = syscall_table(), AUDIT_ARCH[machine()]
    ld, jeq, jset, jge, ret = 0x20, 0x15, 0x45, 0x35, 0x06
    allow, kill = 0x7FFF0000, 0x80000000  # SECCOMP_RET_ALLOW, SECCOMP_RET_KILL_PROCESS
    errno = 0x00050000  # SECCOMP_RET_ERRNO | the error number
    deny, nosys, notty = errno | EPERM, errno | ENOSYS, errno | ENOTTY
    nr, arch_offset = 0, 4  # offsets in struct seccomp_data
    arg0, arg1 = 16, 24  # the low words of args[0] and args[1] (little-endian)
    Instruction = tuple[int, int, int, int]

    def block(name: str, body: list[Instruction]) -> list[Instruction]:
        """``if nr == name: body`` (every body ends in a ret); the caller has nr loaded."""
        if name not in table:
            return []
        return [(jeq, 0, len(body), table[name])] + body

    def one_of(values: tuple[int, ...], then: int, otherwise: int) -> list[Instruction]:
        """``return then if A in values else otherwise``."""
        n = len(values)
        return [(jeq, n - i, 0, v) for i, v in enumerate(values)] + [
            (ret, 0, 0, otherwise),
            (ret, 0, 0, then),
        ]

    program = [(ld, 0, 0, arch_offset), (jeq, 1, 0, arch), (ret, 0, 0, kill), (ld, 0, 0, nr)]
    if machine() == "x86_64":
        program += [(jge, 0, 1, 0x40000000), (ret, 0, 0, kill)]  # the x32 ABI
    for name, group in (("kill", True), ("rt_sigqueueinfo", True), ("tgkill", False)):
        for call in (name, "rt_tgsigqueueinfo") if name == "tgkill" else (name,):
            if pid_namespace:  # a negative pid is a process group (-1: all it may signal)
                body = [(ld, 0, 0, arg0), (jge, 0, 1, 0x80000000), (ret, 0, 0, deny)]
                body.append((ret, 0, 0, allow))
            else:
                body = [(ld, 0, 0, arg0)] + one_of(
                    (own_pid, 0) if group else (own_pid,), allow, deny
                )
            program += block(call, body)
    clone = [(ld, 0, 0, arg0), (jset, 0, 1, NAMESPACE_FLAGS), (ret, 0, 0, deny)]
    if not pid_namespace:
        clone += [(jset, 1, 0, CLONE_THREAD), (ret, 0, 0, deny)]
    program += block("clone", clone + [(ret, 0, 0, allow)])
    program += block("clone3", [(ret, 0, 0, nosys)])
    for name in ("fork", "vfork"):
        program += block(name, [(ret, 0, 0, allow if pid_namespace else deny)])
    program += block("fcntl", [(ld, 0, 0, arg1)] + one_of(DENIED_FCNTL, deny, allow))
    program += block("ioctl", [(ld, 0, 0, arg1)] + one_of(ALLOWED_IOCTL, allow, notty))
    program += block("prlimit64", [(ld, 0, 0, arg0)] + one_of((0,), allow, deny))
    program += block(
        "setpriority",
        [(ld, 0, 0, arg0), (jeq, 0, 2, 0), (ld, 0, 0, arg1)] + one_of((0,), allow, deny),
    )
    # Two chains of comparisons, each jumping to one shared return at the end.
    allowed = [table[name] for name in ALLOWED if name in table]
    denied = [table[name] for name in DENIED if name in table]
    chain = allowed + denied
    if len(chain) + 2 > 255:
        raise ValueError("the seccomp lists outgrew an 8-bit jump: split them")
    for i, number in enumerate(chain):
        to_allow = len(chain) - i + 1  # past the rest of the chain, ENOSYS and EPERM
        program.append((jeq, to_allow if i < len(allowed) else to_allow - 1, 0, number))
    program += [(ret, 0, 0, nosys), (ret, 0, 0, deny), (ret, 0, 0, allow)]
    return b"".join(struct.pack("HBBI", *instruction) for instruction in program)
