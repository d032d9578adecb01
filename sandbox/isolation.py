"""The host side of a run's isolation: picking a fresh uid for it, finding and killing every
process of that uid, and deleting the files it left (its directory, and what it put at the top of
the world-writable directories)."""

from __future__ import annotations

import logging
import os
import random
import signal
import stat
import subprocess
import sys
import threading
import time

IS_LINUX = sys.platform.startswith("linux")
#: Preferred range of the per-run uids (and gids) when running as root: far from real accounts.
SANDBOX_UID_RANGE = (1_900_000_000, 1_900_000_000 + (1 << 24))
logger = logging.getLogger(__name__)


class LaunchError(Exception):
    """The sandbox could not be set up (not the candidate's fault); set-up is retried."""


_uid_lock = threading.Lock()
_uids_in_use: set[int] = set()


def _id_ranges(path: str) -> list[tuple[int, int]]:
    """Mapped id intervals ``[start, end)`` of this user namespace (everything off Linux)."""
    if not IS_LINUX:
        return [(0, 1 << 32)]
    with open(path) as f:
        rows = [line.split() for line in f if line.strip()]
    return [(int(inside), int(inside) + int(count)) for inside, _, count in rows]


def pick_uid() -> int:
    """A random uid (used as gid too) no account, group or running process uses; reserved until
    :func:`release_uid`."""
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
            raise LaunchError("no unused uid range is mapped in this user namespace")
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
            if uid in taken or uid in _uids_in_use or processes_of_uid(uid):
                continue
            _uids_in_use.add(uid)
            return uid
    raise LaunchError(f"could not find an unused uid in [{low}, {high})")


def release_uid(uid: int) -> None:
    """Let :func:`pick_uid` hand out ``uid`` again."""
    with _uid_lock:
        _uids_in_use.discard(uid)


def processes_of_uid(uid: int) -> list[int]:
    """Pids of live (non-zombie) processes whose real, effective, saved or fs uid is ``uid``."""
    if not IS_LINUX:
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


def kill_processes_of_uid(uid: int, deadline_s: float = 5.0) -> list[int]:
    """SIGKILL every process of ``uid`` until none is left (Linux); returns the pids that were
    still alive when ``deadline_s`` ran out (empty on success)."""
    deadline = time.monotonic() + deadline_s
    while True:
        pids = processes_of_uid(uid)
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


def kill_uid_portable(uid: int, interpreter: str) -> None:
    """Off Linux: ``kill(-1, SIGKILL)`` as ``uid`` signals every process of that uid at once."""
    script = f"import os\nos.setgid({uid})\nos.setuid({uid})\nos.kill(-1, 9)\n"
    subprocess.run([interpreter, "-I", "-S", "-c", script], check=False, timeout=30)


def force_rmtree(path: str) -> list[str]:
    """Delete ``path`` (the run's directory, or what it left in a world-writable one) even where
    the candidate made parts of it read-only or unreadable, never following a symbolic link and
    never raising: returns what could not be deleted, each with its reason (also logged).

    Every directory is reached through a descriptor opened with ``O_NOFOLLOW`` from its parent
    and made writable (``0700``) only after it was seen to be a directory, so a link the
    candidate planted (to a file of the trainer's user, or one of root's) is unlinked, never
    changed; the error handler of ``shutil.rmtree`` used to chmod through it.
    """
    failures: list[str] = []
    parent, name = os.path.split(os.path.abspath(path))
    try:
        parent_fd = os.open(parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except FileNotFoundError:
        return []
    except OSError as exc:
        failures.append(f"{parent}: {exc}")
    else:
        try:
            _remove_entry(parent_fd, name, path, failures)
        finally:
            os.close(parent_fd)
    for failure in failures:
        logger.warning("code sandbox: could not delete what a run left: %s", failure)
    return failures


def _remove_entry(dir_fd: int, name: str, shown: str, failures: list[str]) -> None:
    """Delete ``name`` in the directory open as ``dir_fd``, recursively (see
    :func:`force_rmtree`); ``shown`` is its path, for messages."""
    try:
        info = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        if not stat.S_ISDIR(
            info.st_mode
        ):  # a file or a symbolic link: the link goes, not its target
            os.unlink(name, dir_fd=dir_fd)
            return
        if info.st_mode & stat.S_IRWXU != stat.S_IRWXU:
            _make_directory_writable(dir_fd, name)
        fd = os.open(
            name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd
        )
    except FileNotFoundError:
        return
    except OSError as exc:
        failures.append(f"{shown}: {exc}")
        return
    try:
        with os.scandir(fd) as entries:
            names = [entry.name for entry in entries]
        for child in names:
            _remove_entry(fd, child, f"{shown}/{child}", failures)
    except OSError as exc:
        failures.append(f"{shown}: {exc}")
    finally:
        os.close(fd)
    try:
        os.rmdir(name, dir_fd=dir_fd)
    except FileNotFoundError:
        pass
    except OSError as exc:
        failures.append(f"{shown}: {exc}")


def _make_directory_writable(dir_fd: int, name: str) -> None:
    """``chmod 0700`` the directory ``name`` (in ``dir_fd``), failing rather than following a
    symbolic link (Linux: through an ``O_PATH | O_NOFOLLOW | O_DIRECTORY`` descriptor; elsewhere
    ``fchmodat`` with ``AT_SYMLINK_NOFOLLOW``)."""
    if IS_LINUX:
        flags = os.O_PATH | os.O_NOFOLLOW | os.O_DIRECTORY | os.O_CLOEXEC
        fd = os.open(name, flags, dir_fd=dir_fd)  # ENOTDIR (or ELOOP) for a symbolic link
        try:
            os.chmod(f"/proc/self/fd/{fd}", stat.S_IRWXU)  # the directory itself
        finally:
            os.close(fd)
    else:
        os.chmod(name, stat.S_IRWXU, dir_fd=dir_fd, follow_symlinks=False)


def sweep_world_writable(uid: int) -> None:
    """Without private mounts: delete what ``uid`` left at the top of the world-writable dirs."""
    for top in ("/tmp", "/var/tmp", "/dev/shm"):
        try:
            entries = list(os.scandir(top))
        except FileNotFoundError:
            continue
        for entry in entries:
            try:
                if entry.stat(follow_symlinks=False).st_uid == uid:
                    force_rmtree(entry.path)  # logs what it could not delete
            except FileNotFoundError:
                pass
            except OSError as exc:  # never raised into the trainer
                logger.warning("code sandbox: could not check %s: %s", entry.path, exc)
