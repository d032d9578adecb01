"""The sandbox as a boundary: hostile candidates from a sweep of the earlier sandbox, each of which
crashed the trainer, read the answers, reached the host or outlived its run. Each now scores 0 (or
is refused) and leaves nothing behind, in every isolation mode this machine can run.

Parser and judging tests need no sandbox; the rest run real sandboxes (hang guards, not timings).
"""

from __future__ import annotations

import os
import random
import sys

import pytest

from sandbox import parse_tests
from sandbox.plain_data import MAX_SHARED_HASH, Budget, WireError, from_wire, strict_equal
from sandbox.limits import SandboxLimits as Limits
from sandbox.records import RECORD, Channel, Records, Unjudgeable, judge_test, parse_records
from sandbox.records import summarize

pytestmark = pytest.mark.skipif(os.name != "posix", reason="the sandbox needs a POSIX system")

LINUX = sys.platform.startswith("linux")
NONCE = "0123456789abcdef0123456789abcdef"
CHECKS = parse_tests(["assert add(1, 2) == 3", "assert {add(1, 1)} == {2}"])


# --------------------------------------------------------------------------- records and judging


@pytest.mark.parametrize(
    "line",
    [
        f"{NONCE} value --1 0 3",  # int("--1") raised through run_tests
        f"{NONCE} value 0 --0 3",
        f"{NONCE} value -0 0 3",
        f"{NONCE} value 00 0 3",
        f"{NONCE} value +1 0 3",
        f"{NONCE} value 0 0",  # no separator before the text
        f"{NONCE} value 0 0 3\r",
        f"{NONCE} value 0 0 \xe9",
        f"{NONCE} value 1_0 0 3",
        f"{NONCE} value \u0661 0 3",  # an Arabic-Indic digit: str.isdigit() says yes
        f"{NONCE} value 0  0 3",
        f"{NONCE} VALUE 0 0 3",
        f"{NONCE.upper()} value 0 0 3",
        f"{NONCE}0 value 0 0 3",
        f"{NONCE} value 99999999999999999999 0 3",
        f"{NONCE} value 0 0 " + "1" * 70_000,
    ],
)
def test_a_malformed_record_is_counted_as_forged_and_never_raises(line: str) -> None:
    data = (line + "\n").encode("utf-8")
    records = parse_records(data, NONCE, CHECKS)
    assert records.forged == 1 and not records.values and not records.failures


def test_the_record_grammar_accepts_what_the_runner_writes() -> None:
    data = (
        f"{NONCE} start -1 -1 \n{NONCE} value 0 0 3\n{NONCE} fail 1 0 KeyError: 'x'\n"
        f"{NONCE} done -1 -1 \n"
    ).encode()
    records = parse_records(data, NONCE, CHECKS)
    assert records.started and records.done and records.forged == 0
    assert records.values == {(0, 0): "3"} and records.failures == {(1, 0): "KeyError: 'x'"}
    assert RECORD.fullmatch(f"{NONCE} error -1 -1 ".encode()) is not None


def _hostile_line(rng: random.Random) -> bytes:
    pieces = [
        NONCE,
        rng.choice(["value", "fail", "start", "done", "error", "v", ""]),
        rng.choice(["0", "1", "-1", "--1", "-", "", "1e3", "0x1", " 1", "\u0663", "9" * 40]),
        rng.choice(["0", "1", "-1", "--1", "-0", "٣", "9" * 12]),
        rng.choice(['{"set": [1, 1]}', "NaN", "[" * 5000, '{"dict": [[1]]}', "3", "\x00", ""]),
    ]
    line = " ".join(pieces).encode("utf-8", "surrogatepass")
    raw = bytes(rng.randrange(256) for _ in range(rng.randrange(40)))
    return rng.choice([line, raw, line + raw, line[: rng.randrange(len(line) + 1)]])


def test_fuzzed_records_never_raise_and_judging_fails_or_passes() -> None:
    rng = random.Random(1234)
    for _ in range(3000):
        lines = [_hostile_line(rng) for _ in range(rng.randrange(1, 6))]
        data = b"\n".join(lines) + b"\n"
        records = parse_records(data, NONCE, CHECKS)
        for test, checks in enumerate(CHECKS):
            try:
                outcome = judge_test(test, checks, records)
            except Unjudgeable as exc:  # the one exception judging raises: scored 0 above
                outcome = str(exc)
            assert outcome is None or isinstance(outcome, str)
        # What run_tests does with them: a result, never an exception.
        results, output = Channel(-1, 1 << 20), Channel(-1, 100)
        results.data = bytearray(f"{NONCE} start -1 -1 \n".encode() + data)
        result = summarize(output, results, NONCE, CHECKS, Limits(), False, 0, [])
        assert not isinstance(result, str) and 0 <= result.passed <= result.total


def _colliding_ints(n: int) -> list[int]:
    """Integers that all share one hash (hash(k * (2**61 - 1)) == 0 on 64-bit CPython)."""
    return [k * (2**61 - 1) for k in range(1, n + 1)]


@pytest.mark.parametrize("tag", ["set", "frozenset"])
def test_values_built_to_collide_in_hash_are_rejected_before_they_are_built(tag: str) -> None:
    ints = _colliding_ints(3000)
    assert len({hash(i) for i in ints}) == 1
    with pytest.raises(WireError, match="share a hash"):
        from_wire('{"%s": [%s]}' % (tag, ",".join(map(str, ints))))
    with pytest.raises(WireError, match="share a hash"):
        from_wire('{"dict": [%s]}' % ",".join(f"[{i}, 0]" for i in ints))
    # A few shared hashes are normal (hash(-1) == hash(-2)): those still decode.
    few = _colliding_ints(MAX_SHARED_HASH) + [-1, -2]
    assert from_wire('{"set": [%s]}' % ",".join(map(str, few))) == set(few)


def test_colliding_values_score_the_program_zero_with_a_reason() -> None:
    text = '{"set": [%s]}' % ",".join(map(str, _colliding_ints(2500)))
    records = Records(values={(1, 0): text})
    with pytest.raises(Unjudgeable, match="share a hash"):
        judge_test(1, CHECKS[1], records)
    # The whole program scores 0, even with a right answer to the other test.
    results, output = Channel(-1, 1 << 20), Channel(-1, 1)
    lines = ["start -1 -1 ", "value 0 0 3", "value 1 0 " + text, "done -1 -1 "]
    results.data = bytearray("".join(f"{NONCE} {line}\n" for line in lines).encode())
    result = summarize(output, results, NONCE, CHECKS, Limits(), False, 0, [])
    assert not isinstance(result, str)
    assert result.passed == 0 and "share a hash" in result.detail


def test_judging_stops_at_its_cpu_budget() -> None:
    value = [[i, str(i)] for i in range(20_000)]
    with pytest.raises(WireError, match="budget"):
        strict_equal(value, value, Budget(0.0))
    assert strict_equal(value, value, Budget(10.0))


# --------------------------------------------------------------------------- hostile candidates

# Imports for the sandbox runs (kept here so the parser tests above read on their own).
import dataclasses  # noqa: E402
import secrets  # noqa: E402
import socket  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from collections.abc import Iterator  # noqa: E402
from pathlib import Path  # noqa: E402

from sandbox import (  # noqa: E402
    Isolation,
    SandboxLimits,
    TestResult,
    detect_isolation,
    run_tests,
    run_tests_many,
)
from sandbox import isolation as sandbox_host  # noqa: E402
from sandbox import launcher  # noqa: E402
from sandbox import seccomp as sandbox_seccomp  # noqa: E402
from sandbox import run as sandbox_run  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
TASKS = REPO / "examples" / "data" / "code_tasks.jsonl"
LIMITS = SandboxLimits(timeout_s=4.0, cpu_time_s=3, memory_mb=256, isolation="weak")


def _modes() -> dict[str, Isolation]:
    """Each isolation mode this machine runs: "root" (a fresh uid and namespaces, root with
    CAP_SYS_ADMIN), "root-userns" (a fresh uid owning a user namespace: root without
    CAP_SYS_ADMIN, where the interpreter is reachable by other users), "userns" (a user
    namespace owned by the trainer's uid, as a user without root gets; run here even as root),
    "weak" (no namespaces: seccomp and Landlock where the kernel has them, and the audit hook)."""
    if os.name != "posix":
        return {}
    candidates = sandbox_run.candidate_isolations()
    modes = {}
    for isolation in candidates:
        if isolation.strong:
            name = "root-userns" if isolation.user_namespace else "root"
            if not isolation.separate_uid:
                name = "userns"
        else:
            name = "weak-root" if isolation.separate_uid else "weak"
        modes[name] = isolation
    if LINUX and "userns" not in modes:
        modes["userns"] = dataclasses.replace(modes["root-userns"], separate_uid=False)
    return {name: i for name, i in modes.items() if sandbox_run.probe_isolation(i) is None}


MODES = _modes()
ALL_MODES = pytest.mark.parametrize("mode", sorted(MODES))

# Turns the audit hook off (its closure's reentrancy list, reached through gc): every hostile
# candidate below starts with it, so the weak mode is tested on its kernel layers alone.
PRELUDE = """
import gc, os, sys
for _o in gc.get_objects():
    if type(_o).__name__ == "function" and _o.__name__ == "hook" and _o.__closure__:
        for _n, _c in zip(_o.__code__.co_freevars, _o.__closure__):
            if _n == "busy":
                _c.cell_contents.append(1)

def attempt(fn):
    try:
        return fn()
    except BaseException as exc:
        return "failed: " + type(exc).__name__
"""
LIBC = """
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
NR = {table!r}
def syscall(name, *args):
    rc = libc.syscall(NR[name], *args)
    return rc if rc >= 0 else "failed: errno %d" % ctypes.get_errno()
"""


def _libc() -> str:
    return LIBC.format(table=sandbox_seccomp.SYSCALLS.get(sandbox_seccomp.machine(), {}))


def hostile(mode: str, code: str, tests: list[str]) -> TestResult:
    """``PRELUDE + code`` under ``mode``; checks the run ended in bounded time."""
    start = time.monotonic()
    result = run_tests(PRELUDE + code, tests, LIMITS, MODES[mode])
    assert time.monotonic() - start < LIMITS.timeout_s + 10.0, "hang guard"
    return result


def _failed(value: object) -> bool:
    return isinstance(value, str) and value.startswith("failed")


@ALL_MODES
def test_a_forged_record_with_index_minus_minus_one_scores_zero(mode: str) -> None:
    code = """
def f():
    frame = sys._getframe()
    while "nonce" not in frame.f_locals:
        frame = frame.f_back
    os.write(frame.f_locals["fd"], f"{frame.f_locals['nonce']} value --1 0 3\\n".encode())
    return 0
"""
    result = hostile(mode, code, ["assert f() == 3"])
    assert (result.status, result.passed) == ("ok", 0), result.detail
    assert "malformed" in result.detail


@ALL_MODES
def test_values_built_to_collide_in_hash_score_zero(mode: str) -> None:
    code = "def f():\n    return {k * (2**61 - 1) for k in range(1, 2500)}\n"
    result = hostile(mode, code, ["assert f() == {1, 2}", "assert f() != {1, 2}"])
    assert result.passed == 0, result.detail
    assert "share a hash" in result.detail


@pytest.fixture
def host_files() -> Iterator[dict[str, Path]]:
    """A world-readable "home directory" file and a file in the host's /tmp, deleted after."""
    home = Path(tempfile.mkdtemp(prefix="sbx_home_"))
    home.chmod(0o755)
    bashrc = home / ".bashrc"
    bashrc.write_text("# keep me\n")
    bashrc.chmod(0o666)
    fd, tmp_name = tempfile.mkstemp(prefix="sbx_host_tmp_")
    os.close(fd)
    tmp = Path(tmp_name)
    tmp.write_text("host tmp\n")
    tmp.chmod(0o666)
    yield {"home": home, "bashrc": bashrc, "tmp": tmp}
    for path in (bashrc, tmp):
        path.unlink(missing_ok=True)
    for extra in home.iterdir():
        extra.unlink()
    home.rmdir()


@ALL_MODES
def test_the_answers_and_the_host_files_are_not_readable(
    mode: str, host_files: dict[str, Path]
) -> None:
    paths = [str(TASKS), str(REPO / "README.md"), str(host_files["bashrc"]), str(host_files["tmp"])]
    paths += ["/etc/passwd", "/etc/hostname", f"/proc/{os.getpid()}/cmdline"]
    code = f"""
PATHS = {paths!r}
def readable():
    found = []
    for path in PATHS:
        try:
            with open(path, "rb") as f:
                f.read(1)
            found.append(path)
        except OSError:
            pass
    return found

def listed():
    return [d for d in ("/run", "/sys", "/home", "/work") if attempt(lambda: os.listdir(d)) and not _failed(d)]

def _failed(d):
    return isinstance(attempt(lambda: os.listdir(d)), str)

def answer():
    text = open(PATHS[0]).read()
    return 3 if "assert add(1, 2) == 3" in text else 0
"""
    result = hostile(
        mode, code, ["assert readable() == []", "assert listed() == []", "assert answer() == 3"]
    )
    assert result.passed == 2, result.detail
    assert "test 2" in result.detail  # the answer lookup failed


@ALL_MODES
def test_files_of_the_trainers_user_are_not_written_or_deleted(
    mode: str, host_files: dict[str, Path]
) -> None:
    home, bashrc, tmp = host_files["home"], host_files["bashrc"], host_files["tmp"]
    code = f"""
def escapes():
    done = []
    def through_dir_fd():
        fd = os.open({str(home)!r}, os.O_RDONLY)
        out = os.open(".bashrc", os.O_WRONLY | os.O_APPEND, dir_fd=fd)
        os.write(out, b"echo pwned\\n")
        return "appended"
    def delete():
        fd = os.open({str(home)!r}, os.O_RDONLY)
        os.unlink(".bashrc", dir_fd=fd)
        return "deleted"
    def new_file():
        open({str(home / "new")!r}, "w").write("x")
        return "created"
    def overwrite_tmp():
        open({str(tmp)!r}, "r+").write("x")  # "r+": the host's file, not a new one of its own
        return "overwritten"
    def fill(directory):
        def go():
            with open(directory + "/sbx_fill_{secrets.token_hex(4)}", "wb") as f:
                f.write(b"x" * 100_000)
            return "filled " + directory
        return go
    for fn in (through_dir_fd, delete, new_file, overwrite_tmp):
        outcome = attempt(fn)
        if not _failed(outcome):
            done.append(outcome)
    for directory in ("/dev/shm", "/run/lock", "/var/tmp"):  # its own, or denied: host checks
        attempt(fill(directory))
    return done

def _failed(value):
    return isinstance(value, str) and value.startswith("failed")
"""
    before = {p: 0 for p in (Path("/dev/shm"), Path("/run/lock"), Path("/var/tmp")) if p.exists()}
    result = hostile(mode, code, ["assert escapes() == []"])
    assert result.passed == 1, result.detail
    assert bashrc.read_text() == "# keep me\n" and tmp.read_text() == "host tmp\n"
    assert sorted(p.name for p in home.iterdir()) == [".bashrc"]
    for directory in before:
        assert not [p for p in directory.iterdir() if p.name.startswith("sbx_fill_")]


@pytest.fixture
def listeners() -> Iterator[dict[str, object]]:
    """A Unix socket in a world-writable directory of the host's /tmp, an abstract Unix socket,
    and a TCP socket on 127.0.0.1, all listening (non-blocking)."""
    directory = Path(tempfile.mkdtemp(prefix="sbx_sock_"))
    directory.chmod(0o777)
    path = str(directory / "host.sock")
    tag = secrets.token_hex(6)
    sockets = [socket.socket(socket.AF_UNIX), socket.socket(socket.AF_UNIX), socket.socket()]
    sockets[0].bind(path)
    os.chmod(path, 0o777)
    sockets[1].bind("\0sbx_" + tag)
    sockets[2].bind(("127.0.0.1", 0))
    for s in sockets:
        s.listen(4)
        s.setblocking(False)
    yield {
        "path": path,
        "abstract": "\0sbx_" + tag,
        "port": sockets[2].getsockname()[1],
        "all": sockets,
    }
    for s in sockets:
        s.close()
    os.unlink(path)
    directory.rmdir()


@ALL_MODES
def test_no_socket_reaches_the_host(mode: str, listeners: dict) -> None:
    targets = [
        ("AF_UNIX", listeners["path"]),
        ("AF_UNIX", listeners["abstract"]),
        ("AF_INET", ("127.0.0.1", listeners["port"])),
    ]
    code = f"""
import socket
TARGETS = {targets!r}
def connected():
    done = []
    for family, address in TARGETS:
        def go():
            s = socket.socket(getattr(socket, family), socket.SOCK_STREAM)
            s.settimeout(1)
            s.connect(address)
            return "connected %r" % (address,)
        outcome = attempt(go)
        if not outcome.startswith("failed"):
            done.append(outcome)
    for family in ("AF_NETLINK", "AF_INET6"):
        outcome = attempt(lambda: socket.socket(getattr(socket, family), socket.SOCK_DGRAM) and family)
        if not outcome.startswith("failed"):
            done.append(outcome)
    return done
"""
    result = hostile(mode, code, ["assert connected() == []"])
    assert result.passed == 1, result.detail
    for s in listeners["all"]:
        with pytest.raises(BlockingIOError):
            s.accept()  # nothing ever connected


def _host_shm_segments() -> set[str]:
    """Ids of the host's SysV shared memory segments of 64 MiB (the size the candidate asks for:
    other processes on the machine may create segments of their own meanwhile)."""
    with open("/proc/sysvipc/shm") as f:
        rows = [line.split() for line in f.readlines()[1:]]
    return {row[1] for row in rows if int(row[3]) == 64 << 20}


@pytest.mark.skipif(not LINUX, reason="kernel keys and SysV IPC are Linux's")
@ALL_MODES
def test_kernel_keys_and_shared_memory_are_denied_and_nothing_outlives_the_run(mode: str) -> None:
    tag = "sbx_key_" + secrets.token_hex(4)
    code = _libc() + f"""
def key():
    # add_key("user", tag, "secret", 6, KEY_SPEC_SESSION_KEYRING), then make it world-readable
    rc = syscall("add_key", b"user", {tag.encode()!r}, b"secret", 6, -3)
    if not isinstance(rc, str):
        syscall("keyctl", 5, rc, 0x3f3f3f3f)  # KEYCTL_SETPERM
    return rc

def shm():
    # shmget(IPC_PRIVATE, 64 MB, IPC_CREAT | 0o666), then attach and touch it
    return syscall("shmget", 0, 64 << 20, 0o1000 | 0o666)

def memfd():
    return attempt(lambda: os.memfd_create("x"))

def posix_shm():
    def go():
        with open("/dev/shm/sbx_big", "wb") as f:
            for _ in range(64):
                f.write(b"x" * (1 << 20))
        return "64 MB in /dev/shm"
    return attempt(go)

def escaped():
    outcomes = {{"key": key(), "shm": shm(), "memfd": memfd(), "posix_shm": posix_shm()}}
    return sorted(name for name, value in outcomes.items() if not str(value).startswith("failed"))
"""
    shm_before = _host_shm_segments()
    result = hostile(mode, code, ["assert escaped() == []"])
    assert result.passed == 1, result.detail
    assert _host_shm_segments() <= shm_before
    with open("/proc/keys") as f:
        assert tag not in f.read()
    assert not Path("/dev/shm/sbx_big").exists()


@pytest.mark.skipif(not LINUX, reason="pidfds, ptrace and /proc are Linux's")
@ALL_MODES
def test_the_trainer_cannot_be_signalled_traced_or_read(
    mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    secret = "sbx_secret_" + secrets.token_hex(6)
    monkeypatch.setenv("PPO_SBX_SECRET", secret)  # /proc/<pid>/environ shows the initial one:
    trainer = os.getpid()  # the memory read below is the check that matters for the secret
    code = _libc() + f"""
import signal
TRAINER = {trainer}
def escaped():
    outcomes = {{
        "kill": attempt(lambda: os.kill(TRAINER, 0) or "sent"),
        "kill -1": attempt(lambda: os.kill(-1, 0) or "sent"),
        "pidfd": attempt(lambda: signal.pidfd_send_signal(os.pidfd_open(TRAINER), 0) or "sent"),
        "ptrace": syscall("ptrace", 16, TRAINER, 0, 0),  # PTRACE_ATTACH
        "environ": attempt(lambda: open(f"/proc/{{TRAINER}}/environ", "rb").read()[:10]),
        "mem": attempt(lambda: open(f"/proc/{{TRAINER}}/mem", "rb") and "opened"),
        "parent environ": attempt(lambda: open(f"/proc/{{os.getppid()}}/environ", "rb").read()[:10]),
        "unshare": syscall("unshare", 0x10000000),  # CLONE_NEWUSER
    }}
    return sorted(name for name, value in outcomes.items() if not str(value).startswith("failed"))
"""
    result = hostile(mode, code, ["assert escaped() == []"])
    assert result.passed == 1, result.detail
    assert secret not in result.output


def _processes_with(tag: str) -> list[int]:
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if tag.encode() in f.read():
                    found.append(int(pid))
        except OSError:
            continue
    return found


@pytest.mark.skipif(not LINUX, reason="the process check reads /proc")
@ALL_MODES
def test_a_setsid_daemon_does_not_outlive_the_run(mode: str) -> None:
    tag = "sbx_daemon_" + secrets.token_hex(6)
    code = f"""
import time
def daemon():
    def go():
        if os.fork() == 0:
            os.setsid()
            if os.fork() == 0:
                os.execv(sys.executable, [sys.executable, "-c", "import time; time.sleep(60)", {tag!r}])
            os._exit(0)
        time.sleep(0.3)
        return "started"
    return attempt(go)
"""
    hostile(mode, code, ["assert daemon() == 'x'"])
    assert _processes_with(tag) == []


@ALL_MODES
def test_a_neighbour_in_the_batch_is_neither_read_nor_sabotaged(mode: str) -> None:
    victim = """
import time
open("mine.txt", "w").write("mine")
def untouched():
    time.sleep(1.0)
    return sorted(os.listdir(".")) == ["mine.txt"] and open("mine.txt").read() == "mine"
"""
    attacker = """
import glob
def sabotaged():
    done = []
    for mine in glob.glob("/tmp/*/mine.txt") + glob.glob("/proc/*/cwd/mine.txt"):
        outcome = attempt(lambda: open(mine, "w").write("gone"))
        if not str(outcome).startswith("failed"):
            done.append(mine)
    return done
"""
    sandbox_run._detected = MODES[mode]  # run_tests_many uses the detected isolation
    try:
        codes = [PRELUDE + victim, PRELUDE + "import time\ntime.sleep(0.3)\n" + attacker]
        results = run_tests_many(
            codes, [["assert untouched()"], ["assert sabotaged() == []"]], LIMITS, max_workers=2
        )
    finally:
        sandbox_run._detected = None
    assert [r.passed for r in results] == [1, 1], [r.detail for r in results]


def test_weak_isolation_is_refused_unless_the_user_opts_in() -> None:
    weak = Isolation(False, False, False, False, audit_hook=True)
    with pytest.raises(RuntimeError, match='isolation="weak"'):
        run_tests("def f():\n    return 1\n", ["assert f() == 1"], SandboxLimits(), weak)
    opted_in = SandboxLimits(isolation="weak")
    assert run_tests("def f():\n    return 1\n", ["assert f() == 1"], opted_in, weak).passed == 1
    assert sandbox_run.weak_isolation_gaps(weak)
    assert all(
        sandbox_run.weak_isolation_gaps(m) == []
        for n, m in MODES.items()
        if n in ("root", "userns")
    )


@pytest.mark.skipif(not LINUX, reason="the namespaces are Linux's")
def test_a_strong_isolation_is_detected_here() -> None:
    """Root, or a kernel with user namespaces (this suite's machines), gets a strong mode."""
    assert detect_isolation().strong
    assert {"root", "userns"} & set(MODES) if os.geteuid() == 0 else "userns" in MODES


@ALL_MODES
def test_an_honest_solution_still_scores_full_marks(mode: str) -> None:
    import json

    task = json.loads(TASKS.read_text().splitlines()[0])
    result = run_tests(task["prompt"] + task["solution"], task["tests"], LIMITS, MODES[mode])
    assert (result.status, result.fraction) == ("ok", 1.0), result.detail


@ALL_MODES
def test_a_fork_bomb_gets_at_most_max_processes(mode: str) -> None:
    if mode == "userns" and os.geteuid() == 0:
        pytest.skip("RLIMIT_NPROC never counts uid 0: root gets the root or root-userns mode")
    code = """
import time
def forks():
    count = 0
    for _ in range(60):
        try:
            pid = os.fork()
        except OSError:
            break
        if pid == 0:
            time.sleep(3)
            os._exit(0)
        count += 1
    return count
"""
    result = hostile(mode, code, ["assert forks() > 100"])
    assert result.passed == 0
    assert "forks() gave" in result.detail, result.detail
    count = int(result.detail.split("forks() gave ")[1].split(";")[0].split(" ")[0])
    assert count < LIMITS.max_processes, result.detail


# --------------------------------------------------------------------------- as a non-root user

NON_ROOT_SCRIPT = r"""
import json, os, socket, sys
sys.path.insert(0, sys.argv[1])
from sandbox import SandboxLimits, detect_isolation, run_tests
from sandbox.seccomp import SYSCALLS, machine
PRELUDE, LIBC, TASKS, HOME_FILE, TAG = sys.argv[2:7]
LIBC = LIBC.format(table=SYSCALLS.get(machine(), {}))
isolation = detect_isolation()
trainer = os.getpid()
server = socket.socket()
server.bind(("127.0.0.1", 0))
server.listen(1)
port = server.getsockname()[1]
ESCAPED = "def escaped():\n    return sorted(k for k, v in OUT.items() if not str(v).startswith('failed'))\n"
cases = {
    "answers": f"OUT = {{'read': attempt(lambda: open({TASKS!r}).read(5))}}\n",
    "home": f"OUT = {{'append': attempt(lambda: open({HOME_FILE!r}, 'a').write('x'))}}\n",
    "trainer": LIBC + "import signal\n" + f"T = {trainer}\n" + (
        "OUT = {'kill': attempt(lambda: os.kill(T, 0) or 'sent'),\n"
        " 'pidfd': attempt(lambda: signal.pidfd_send_signal(os.pidfd_open(T), 0) or 'sent'),\n"
        " 'ptrace': syscall('ptrace', 16, T, 0, 0),\n"
        " 'mem': attempt(lambda: open(f'/proc/{T}/mem', 'rb') and 'opened'),\n"
        " 'environ': attempt(lambda: open(f'/proc/{T}/environ', 'rb').read(5))}\n"
    ),
    "kernel": LIBC + (
        "OUT = {'key': syscall('add_key', b'user', b'sbx', b'secret', 6, -3),\n"
        " 'shm': syscall('shmget', 0, 1 << 20, 0o1666)}\n"
    ),
    "sockets": "import socket\n" + (
        f"OUT = {{'tcp': attempt(lambda: socket.create_connection(('127.0.0.1', {port}), 1) and 'connected'),\n"
        " 'abstract': attempt(lambda: socket.socket(socket.AF_UNIX).bind('\\0sbx') or 'bound')}\n"
    ),
    "daemon": (
        "import time\n"
        "def go():\n"
        "    if os.fork() == 0:\n"
        "        os.setsid()\n"
        f"        os.execv(sys.executable, [sys.executable, '-c', 'import time; time.sleep(60)', {TAG!r}])\n"
        "    time.sleep(0.3)\n"
        "    return 'started'\n"
        "OUT = {}\n"
        "attempt(go)\n"
    ),
}
out = {"strong": isolation.strong, "isolation": isolation.describe(), "uid": os.getuid()}
limits = SandboxLimits(timeout_s=4.0)
for name, code in cases.items():
    result = run_tests(PRELUDE + code + ESCAPED, ["assert escaped() == []"], limits)
    out[name] = [result.passed, result.detail]
server.setblocking(False)
try:
    server.accept()
    out["accepted"] = True
except BlockingIOError:
    out["accepted"] = False
print(json.dumps(out))
"""


NON_ROOT_WEAK_SCRIPT = r"""
import glob, json, os, resource, subprocess, sys, tempfile, time
sys.path.insert(0, sys.argv[1])
from sandbox import SandboxLimits, WORKDIR_PREFIX, run_tests
from sandbox import run as sandbox_run
PRELUDE, HOME_DIR, HOME_FILE, ROOT_FILE, KERNEL_RESOURCES, FLOOD = sys.argv[2:8]
weak = [i for i in sandbox_run.candidate_isolations() if not i.strong][-1]
out = {"isolation": weak.describe(), "uid": os.getuid()}
# Another process of the trainer's user, in the trainer's process group.
victim = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
SIGNALS = '''
import fcntl, socket, struct, time
VICTIM = %d
def arm(owner, how):
    def go():
        if how == "SIOCSPGRP":
            a, b = socket.socketpair()
            KEEP.append((a, b))
            r, write = a.fileno(), lambda: b.send(b"x")
        else:
            r, w = os.pipe()
            write = lambda: os.write(w, b"x")
        fcntl.fcntl(r, fcntl.F_SETFL, os.O_ASYNC | os.O_NONBLOCK)
        if how == "F_SETOWN":
            fcntl.fcntl(r, fcntl.F_SETOWN, owner)
        elif how == "F_SETOWN_EX":
            fcntl.fcntl(r, 15, struct.pack("ii", 2 if owner < 0 else 1, abs(owner)))
        else:
            fcntl.ioctl(r, 0x8901 if how == "FIOSETOWN" else 0x8902, struct.pack("i", owner))
        fcntl.fcntl(r, 10, 9)  # F_SETSIG: SIGKILL
        write()
        return "armed"
    return attempt(go)
KEEP = []
def armed():
    trainer = os.getppid()
    owners = {"trainer": trainer, "its group": -os.getpgid(trainer), "victim": VICTIM}
    done = [how + " " + who for who, owner in owners.items()
            for how in ("F_SETOWN", "F_SETOWN_EX", "FIOSETOWN", "SIOCSPGRP")
            if arm(owner, how) == "armed"]
    time.sleep(0.2)
    return done
''' % victim.pid
limits = SandboxLimits(timeout_s=4.0, isolation="weak")
result = run_tests(PRELUDE + SIGNALS, ["assert armed() == []"], limits, weak)
out["signals"] = [result.passed, result.detail]
time.sleep(0.2)
out["victim alive"] = victim.poll() is None
victim.kill()
def trap(*targets):
    links = "".join(f"    os.symlink({t!r}, 'trap/{i}')\n" for i, t in enumerate(targets))
    return "def planted():\n    os.mkdir('trap')\n" + links + "    os.chmod('trap', 0o500)\n    return 1\n"
for name, targets in (("user files", (HOME_FILE, HOME_DIR)), ("root file", (ROOT_FILE,))):
    try:
        result = run_tests(PRELUDE + trap(*targets), ["assert planted() == 1"], limits, weak)
        out[name] = [result.passed, result.detail]
    except OSError as exc:
        out[name] = [0, "raised " + repr(exc)]
out["modes"] = [oct(os.stat(p).st_mode & 0o7777) for p in (HOME_FILE, HOME_DIR, ROOT_FILE)]
result = run_tests(PRELUDE + KERNEL_RESOURCES, ["assert escaped() == []"], limits, weak)
out["kernel"] = [result.passed, result.detail]
def cpu():
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime
short = SandboxLimits(timeout_s=2.0, isolation="weak")
start = cpu()
honest = run_tests("def f():\n    return 1\n", ["assert f() == 1"], short, weak)
honest_cpu = cpu() - start
start = cpu()
flooded = run_tests(PRELUDE + FLOOD, ["assert flood() == 1"], short, weak)
out["flood"] = [honest.passed, flooded.passed, honest_cpu, cpu() - start, len(flooded.output)]
out["left"] = glob.glob(os.path.join(tempfile.gettempdir(), WORKDIR_PREFIX + "*"))
print(json.dumps(out))
"""


def _world_readable(path: Path) -> bool:
    """Other users may read ``path`` and enter every directory above it."""
    return bool(path.stat().st_mode & 0o004) and all(p.stat().st_mode & 0o001 for p in path.parents)


@pytest.fixture
def new_user() -> Iterator[tuple[int, str]]:
    """A user created for the test (its uid, and the system python3 it runs), deleted after with
    every process of it; skips where the machine cannot run the sandbox as another user."""
    import shutil
    import subprocess

    if not (LINUX and os.geteuid() == 0):
        pytest.skip("creates a user: needs root")
    python = shutil.which("python3", path="/usr/bin:/bin")
    if not (shutil.which("useradd") and shutil.which("setpriv") and python):
        pytest.skip("needs useradd, setpriv and a system python3")
    version = subprocess.run(
        [python, "-c", "import sys; print(sys.version_info >= (3, 10))"],
        capture_output=True,
        text=True,
    )
    if version.stdout.strip() != "True" or not _world_readable(REPO / "sandbox" / "run.py"):
        pytest.skip("the system python3 is older than 3.10, or the checkout is not world-readable")
    user = "sbx" + secrets.token_hex(4)
    subprocess.run(
        ["useradd", "--no-create-home", "--shell", "/usr/sbin/nologin", user], check=True
    )
    uid = None
    try:
        uid = int(
            subprocess.run(["id", "-u", user], capture_output=True, text=True, check=True).stdout
        )
        yield uid, python
    finally:
        if uid is not None:
            sandbox_host.kill_processes_of_uid(uid)  # after a failure: leave none behind
        subprocess.run(["userdel", user], check=False)


def _run_as(uid: int, python: str, script: str, args: list[str], cwd: Path) -> dict:
    """``python -I -c script *args`` as ``uid``, in a session of its own (a candidate that
    signals the trainer's process group stops there); its last line of output, as JSON. Fails
    the test with its stderr, or its death by a signal, otherwise."""
    import json
    import subprocess

    run = subprocess.run(
        ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--reset-env"]
        + [python, "-I", "-c", script, *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=cwd,
        start_new_session=True,
    )
    assert run.returncode == 0, (run.returncode, run.stderr[-3000:])
    return json.loads(run.stdout.splitlines()[-1])


def test_as_a_non_root_user_every_case_is_contained(
    new_user: tuple[int, str], tmp_path: Path
) -> None:
    """A user created for the test runs the sandbox as a user without root does (a user
    namespace of its own), with a world-readable interpreter (the system's python3)."""
    uid, python = new_user
    home = tmp_path / "home"
    home.mkdir()
    home_file = home / ".bashrc"
    home_file.write_text("# keep me\n")
    for path in (tmp_path, home, home_file):
        os.chown(path, uid, uid)
    tag = "sbx_daemon_" + secrets.token_hex(6)
    args = [str(REPO), PRELUDE, LIBC, str(TASKS), str(home_file), tag]
    out = _run_as(uid, python, NON_ROOT_SCRIPT, args, tmp_path)
    assert out["uid"] == uid and out["strong"], out
    for name in ("answers", "home", "trainer", "kernel", "sockets", "daemon"):
        assert out[name][0] == 1, (name, out[name][1])
    assert out["accepted"] is False
    assert home_file.read_text() == "# keep me\n"
    assert _processes_with(tag) == []


def test_weak_mode_as_a_non_root_user_holds(new_user: tuple[int, str]) -> None:
    """The weak mode with a trainer that is not root (a Mac user's only mode; Linux without user
    namespaces), where the candidate runs as the trainer's user: F_SETOWN, F_SETOWN_EX,
    FIOSETOWN and SIOCSPGRP with F_SETSIG = SIGKILL reach neither the trainer, nor its process
    group, nor another process of the user (they killed the trainer); symbolic links left in a
    read-only directory neither change the user's files nor raise out of run_tests (the cleanup
    chmodded through them); the kernel resources and the output flood of the other modes' tests
    are contained as well."""
    uid, python = new_user
    home = Path(tempfile.mkdtemp(prefix="sbx_weak_home_"))
    try:
        home.chmod(0o755)
        home_file = home / "notes.txt"
        home_file.write_text("mine\n")
        home_file.chmod(0o644)
        os.chown(home, uid, uid)
        os.chown(home_file, uid, uid)
        root_file = home / "root_owned"
        root_file.write_text("root's\n")
        root_file.chmod(0o644)
        args = [str(REPO), PRELUDE, str(home), str(home_file), str(root_file)]
        args += [KERNEL_RESOURCES, FLOOD]
        out = _run_as(uid, python, NON_ROOT_WEAK_SCRIPT, args, home)
    finally:
        for path in home.iterdir():
            path.unlink()
        home.rmdir()
    assert out["uid"] == uid and "seccomp" in out["isolation"], out
    assert out["signals"][0] == 1 and out["victim alive"], out
    assert out["user files"][0] == 1 and out["root file"][0] == 1, out
    assert out["modes"] == ["0o644", "0o755", "0o644"], out
    assert out["left"] == [], out
    assert out["kernel"][0] == 1, out["kernel"]
    honest_passed, flood_passed, honest_cpu, flood_cpu, kept = out["flood"]
    assert (honest_passed, flood_passed) == (1, 0) and kept <= SandboxLimits().max_output_bytes
    assert flood_cpu < 5 * honest_cpu + 0.15, out["flood"]


@pytest.mark.parametrize("arch", sorted(sandbox_seccomp.SYSCALLS))
def test_the_seccomp_program_is_well_formed_on_every_architecture(
    arch: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every named call has a number, every jump lands inside the program, and every path ends in
    a return (checked for the architectures this machine cannot run too)."""
    import struct

    monkeypatch.setattr(sandbox_seccomp, "machine", lambda: arch)
    table = sandbox_seccomp.SYSCALLS[arch]
    named = (
        set(sandbox_seccomp.ALLOWED)
        | set(sandbox_seccomp.CONDITIONAL)
        | set(sandbox_seccomp.DENIED)
    )
    x86_only = {name for name in named if name not in sandbox_seccomp.SYSCALLS["aarch64"]}
    assert named - x86_only <= set(table) and set(sandbox_seccomp.DENIED) <= set(table)
    assert not set(sandbox_seccomp.ALLOWED) & (
        set(sandbox_seccomp.DENIED) | set(sandbox_seccomp.CONDITIONAL)
    )
    for pid_namespace in (True, False):
        program = sandbox_seccomp.seccomp_program(own_pid=2, pid_namespace=pid_namespace)
        instructions = [
            struct.unpack("HBBI", program[i : i + 8]) for i in range(0, len(program), 8)
        ]
        assert 0 < len(instructions) < 4096 and instructions[-1][0] == 0x06  # ends in a return
        for index, (code, jt, jf, _) in enumerate(instructions):
            if code & 0x07 == 0x05:  # a jump: both targets inside the program
                assert index + 1 + max(jt, jf) < len(instructions)
        denied = {k for code, _, _, k in instructions if code == 0x15}
        assert {table[name] for name in sandbox_seccomp.DENIED} <= denied


# --------------------------------------------------------------------------- the launcher's race


def test_killing_an_already_reaped_pid_1_is_quiet() -> None:
    """The launcher's SIGTERM handler may run after it reaped its pid 1 (the trainer's cleanup
    comes just as the run ends): it once raised there and wrote a stray LAUNCH_ERROR line."""
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    pidfd = os.pidfd_open(pid) if hasattr(os, "pidfd_open") else -1
    os.waitpid(pid, 0)
    launcher.kill_quietly(pid, pidfd)  # neither raises
    if pidfd >= 0:
        launcher.kill_quietly(pid)
        os.close(pidfd)


@pytest.mark.slow
@pytest.mark.parametrize("mode", sorted(m for m in MODES if MODES[m].pid_namespace))
def test_a_hundred_honest_runs_carry_no_spurious_note(mode: str) -> None:
    """About 1 run in 10 of the PID-namespace modes used to end with "(1 result lines without
    the nonce, or malformed, ignored)": the launcher's late LAUNCH_ERROR line. 100 runs miss a
    fault that frequent with a probability of 0.9 ** 100, about 3e-5."""
    code, tests = "def f():\n    return 1\n", ["assert f() == 1"]
    sandbox_run._detected = MODES[mode]  # run_tests_many uses the detected isolation
    try:
        results = run_tests_many([code] * 100, [tests] * 100, LIMITS, max_workers=2)
    finally:
        sandbox_run._detected = None
    spurious = [r.detail for r in results if r.detail != "1/1 tests passed" or r.status != "ok"]
    assert spurious == [], spurious[:3]


# --------------------------------------------------------------------------- round three

# AIO (the host's whole fs.aio-max-nr pool), io_uring, memfd_secret (memory past RLIMIT_AS),
# flock and POSIX locks on a file shared read-only with the host (the interpreter), and calls a
# newer kernel added (listmount, open_tree_attr) or a future one will add.
KERNEL_RESOURCES = """
import ctypes, fcntl
libc = ctypes.CDLL(None, use_errno=True)
def raw(number, *args):
    rc = libc.syscall(number, *args)
    return rc if rc >= 0 else "failed: errno %d" % ctypes.get_errno()

def listmount():
    request = (ctypes.c_uint64 * 3)(24, (1 << 64) - 1, 0)  # struct mnt_id_req: LSMT_ROOT
    return raw(458, request, (ctypes.c_uint64 * 64)(), 64, 0)

def escaped():
    shared = os.open(os.path.realpath(sys.executable), os.O_RDONLY)
    io_setup = 0 if os.uname().machine == "aarch64" else 206
    outcomes = {
        "io_setup": raw(io_setup, 1024, ctypes.byref(ctypes.c_ulong(0))),
        "io_uring": raw(425, 8, ctypes.create_string_buffer(120)),
        "memfd_secret": raw(447, 0),
        "flock": attempt(lambda: fcntl.flock(shared, fcntl.LOCK_EX | fcntl.LOCK_NB) or "locked"),
        "lockf": attempt(lambda: fcntl.lockf(shared, fcntl.LOCK_SH | fcntl.LOCK_NB) or "locked"),
        "listmount": listmount(),
        "open_tree_attr": raw(467, -100, b"/", 0, None, 0),
        "a future call": raw(511),
    }
    return sorted(name for name, value in outcomes.items() if not str(value).startswith("failed"))
"""
# Every thread (and, where it may fork, every process) writes to stdout and stderr at full speed.
FLOOD = """
import threading
def flood():
    block = b"x" * 65536
    def write():
        while True:
            os.write(1, block)
            os.write(2, block)
    for _ in range(3):
        threading.Thread(target=write, daemon=True).start()
    for _ in range(3):
        try:
            if os.fork() == 0:
                write()
        except OSError:
            break
    write()
"""


@pytest.mark.skipif(not LINUX, reason="the seccomp filter is Linux's")
@ALL_MODES
def test_shared_kernel_resources_and_new_calls_are_denied(mode: str) -> None:
    """AIO (the host's whole fs.aio-max-nr pool), io_uring, memfd_secret (memory past RLIMIT_AS),
    flock and POSIX locks on a file shared read-only with the host (they block host processes),
    and calls a newer kernel added (listmount, open_tree_attr) or a future one will add."""
    result = hostile(mode, KERNEL_RESOURCES, ["assert escaped() == []"])
    assert result.passed == 1, result.detail


@pytest.fixture
def victim() -> Iterator[int]:
    """A process of the trainer's user in a session and process group of its own."""
    import subprocess

    proc = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True
    )
    yield proc.pid
    proc.kill()
    proc.wait()


SIGIO = """
import fcntl, socket, struct, time
def arm(owner, how):
    def go():
        if how == "SIOCSPGRP":
            a, b = socket.socketpair()
            KEEP.append((a, b))
            r, write = a.fileno(), lambda: b.send(b"x")
        else:
            r, w = os.pipe()
            write = lambda: os.write(w, b"x")
        fcntl.fcntl(r, fcntl.F_SETFL, os.O_ASYNC | os.O_NONBLOCK)
        if how == "F_SETOWN":
            fcntl.fcntl(r, fcntl.F_SETOWN, owner)
        elif how == "F_SETOWN_EX":
            fcntl.fcntl(r, 15, struct.pack("ii", 2 if owner < 0 else 1, abs(owner)))
        else:
            fcntl.ioctl(r, 0x8901 if how == "FIOSETOWN" else 0x8902, struct.pack("i", owner))
        fcntl.fcntl(r, 10, 9)  # F_SETSIG: SIGKILL
        write()
        return "armed"
    return attempt(go)
KEEP = []
def armed():
    done = [how + " " + str(owner) for owner in OWNERS
            for how in ("F_SETOWN", "F_SETOWN_EX", "FIOSETOWN", "SIOCSPGRP")
            if arm(owner, how) == "armed"]
    time.sleep(0.2)
    return done
"""


@pytest.mark.skipif(not LINUX, reason="F_SETSIG is Linux's")
@ALL_MODES
def test_no_signal_reaches_another_process_through_f_setown(mode: str, victim: int) -> None:
    """The kernel signals a file's owner when it is ready: F_SETOWN (and F_SETOWN_EX, FIOSETOWN,
    SIOCSPGRP) naming another process or group, with F_SETSIG = SIGKILL, killed it."""
    code = f"OWNERS = ({victim}, {-victim})\n" + SIGIO
    result = hostile(mode, code, ["assert armed() == []"])
    assert result.passed == 1, result.detail
    time.sleep(0.1)
    assert Path(f"/proc/{victim}").exists(), "the victim was killed"


PID_NAMESPACE_MODES = pytest.mark.parametrize(
    "mode", sorted(m for m in MODES if MODES[m].pid_namespace)
)


@PID_NAMESPACE_MODES
def test_pid_1_is_as_confined_as_the_candidate(mode: str) -> None:
    """Pid 1 of the namespace ran with the user namespace's full capabilities and neither
    seccomp nor Landlock; the candidate shared the launcher's process group (outside)."""
    code = """
def pid_1():
    with open("/proc/1/status") as f:
        fields = dict(line.split(":", 1) for line in f if ":" in line)
    found = {k: fields[k].strip() for k in ("CapEff", "CapPrm", "NoNewPrivs", "Seccomp")}
    found["group"] = os.getpgid(0)
    return found
"""
    caps = "0000000000000000"
    expected = {"CapEff": caps, "CapPrm": caps, "NoNewPrivs": "1", "Seccomp": "2", "group": 1}
    result = hostile(mode, code, [f"assert pid_1() == {expected!r}"])
    assert result.passed == 1, result.detail


def _stopped_children() -> list[int]:
    """Children of this process that are stopped (state T)."""
    stopped = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[1] == str(os.getpid()) and fields[0] == "T":
            stopped.append(int(pid))
    return stopped


@pytest.mark.skipif(not LINUX, reason="reads /proc")
@PID_NAMESPACE_MODES
def test_the_launcher_is_out_of_the_candidates_process_group(mode: str) -> None:
    """kill(0, SIGSTOP) from the candidate stopped the launcher outside the namespace (the
    trainer's cleanup then waited 2 s for it on every run)."""
    import threading

    code = """
import signal, time
def stop_group():
    if os.fork() == 0:
        time.sleep(0.3)
        os.kill(0, signal.SIGSTOP)
        os._exit(0)
    time.sleep(5)
    return 1
"""
    seen: list[int] = []
    done = threading.Event()

    def watch() -> None:
        while not done.wait(0.02):
            seen.extend(_stopped_children())

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        limits = dataclasses.replace(LIMITS, timeout_s=1.5)
        result = run_tests(PRELUDE + code, ["assert stop_group() == 1"], limits, MODES[mode])
    finally:
        done.set()
        watcher.join()
    assert result.status == "timeout", result.detail
    assert seen == [], "the launcher was stopped"


@ALL_MODES
def test_a_flood_of_output_costs_the_trainer_little_cpu(mode: str) -> None:
    """Every process (or thread) of the candidate writing to stdout as fast as it can made the
    trainer read gigabytes: about 1 CPU second per program against 0.02 s for an honest one.
    Past max_output_bytes the trainer stops paying (measured: this process's CPU time)."""
    import resource

    def trainer_cpu(code: str, tests: list[str]) -> tuple[float, TestResult]:
        usage = resource.getrusage(resource.RUSAGE_SELF)
        before = usage.ru_utime + usage.ru_stime
        result = run_tests(code, tests, limits, MODES[mode])
        usage = resource.getrusage(resource.RUSAGE_SELF)
        return usage.ru_utime + usage.ru_stime - before, result

    limits = dataclasses.replace(LIMITS, timeout_s=2.0)
    honest_cpu, honest = trainer_cpu("def f():\n    return 1\n", ["assert f() == 1"])
    flood_cpu, flooded = trainer_cpu(PRELUDE + FLOOD, ["assert flood() == 1"])
    assert honest.passed == 1 and flooded.passed == 0
    assert len(flooded.output) <= limits.max_output_bytes
    assert flood_cpu < 5 * honest_cpu + 0.15, (flood_cpu, honest_cpu, flooded.detail)


def _filter_answer(program: bytes, arch: str, nr: int, *args: int) -> str:
    """What the seccomp ``program`` answers to call ``nr`` with ``args`` (a small interpreter of
    the five BPF instructions the filter uses): "allow", "kill" or the errno's name."""
    import errno
    import struct

    words = {0: nr, 4: sandbox_seccomp.AUDIT_ARCH[arch]}  # struct seccomp_data: nr, arch, ip, args
    for i, arg in enumerate(args):
        words[16 + 8 * i] = arg & 0xFFFFFFFF
        words[20 + 8 * i] = (arg >> 32) & 0xFFFFFFFF
    code = [struct.unpack("HBBI", program[i : i + 8]) for i in range(0, len(program), 8)]
    pc, acc = 0, 0
    while True:
        op, jt, jf, k = code[pc]
        if op == 0x20:  # ld [k]
            acc = words.get(k, 0)
        elif op in (0x15, 0x35, 0x45):  # jeq, jge, jset
            taken = {0x15: acc == k, 0x35: acc >= k, 0x45: bool(acc & k)}[op]
            pc += jt if taken else jf
        else:
            assert op == 0x06, f"unexpected instruction {op:#x}"
            if k == 0x7FFF0000:
                return "allow"
            if k == 0x80000000:
                return "kill"
            assert k & 0xFFFF0000 == 0x00050000
            return errno.errorcode[k & 0xFFFF]
        pc += 1


@pytest.mark.parametrize("arch", sorted(sandbox_seccomp.SYSCALLS))
def test_the_seccomp_filter_allows_only_its_allowlist(
    arch: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Run on every architecture's program (an interpreter of the filter): every allowed call is
    allowed, every denied one EPERM, a number no kernel has yet ENOSYS, and each condition."""
    monkeypatch.setattr(sandbox_seccomp, "machine", lambda: arch)
    table = sandbox_seccomp.SYSCALLS[arch]
    own = 4242
    weak = sandbox_seccomp.seccomp_program(own_pid=own, pid_namespace=False)
    ns = sandbox_seccomp.seccomp_program(own_pid=own, pid_namespace=True)
    for program in (weak, ns):
        answer = lambda name, *args: _filter_answer(program, arch, table[name], *args)  # noqa
        assert all(answer(n) == "allow" for n in sandbox_seccomp.ALLOWED if n in table)
        assert all(answer(n) == "EPERM" for n in sandbox_seccomp.DENIED)
        assert _filter_answer(program, arch, 511) == "ENOSYS"  # a future kernel's call
        assert _filter_answer(program, arch, 458) == "ENOSYS"  # listmount (6.8)
        assert _filter_answer(program, "x86_64" if arch != "x86_64" else "aarch64", 0) == "kill"
        assert answer("clone3") == "ENOSYS" and answer("clone", 0x10000000) == "EPERM"
        assert answer("fcntl", 3, 8) == "EPERM" and answer("fcntl", 3, 10) == "EPERM"  # F_SETOWN
        assert answer("fcntl", 3, 1) == "allow" and answer("fcntl", 3, 4) == "allow"  # F_GETFD
        assert answer("fcntl", 3, 6) == "EPERM" and answer("fcntl", 3, 1024) == "EPERM"  # locks
        assert answer("ioctl", 3, 0x5401) == "allow"  # TCGETS
        assert answer("ioctl", 3, 0x8901) == "ENOTTY" and answer("ioctl", 3, 0x8902) == "ENOTTY"
        assert answer("prlimit64", 0, 7) == "allow" and answer("prlimit64", 1, 7) == "EPERM"
        assert answer("setpriority", 0, 0, 5) == "allow"
        assert answer("setpriority", 1, 0, 5) == "EPERM"  # PRIO_PGRP
        assert answer("setpriority", 0, 77, 5) == "EPERM"
        assert answer("kill", own, 9) == "allow" and answer("kill", 0, 9) == "allow"
        assert answer("kill", -1, 9) == "EPERM" and answer("kill", -own, 9) == "EPERM"
    weak_answer = lambda name, *args: _filter_answer(weak, arch, table[name], *args)  # noqa
    ns_answer = lambda name, *args: _filter_answer(ns, arch, table[name], *args)  # noqa
    assert weak_answer("kill", own + 1, 9) == "EPERM" and ns_answer("kill", own + 1, 9) == "allow"
    assert weak_answer("tgkill", own + 1, 1, 9) == "EPERM"
    assert weak_answer("tgkill", own, own, 9) == "allow"
    assert weak_answer("clone", 0x11) == "EPERM" and ns_answer("clone", 0x11) == "allow"
    assert weak_answer("clone", 0x3D0F00) == "allow"  # a thread (CLONE_THREAD | CLONE_VM ...)


HONEST_STDLIB = """
import hashlib, os, random, resource, select, shutil, signal, sqlite3, sys, tempfile, threading
import time
def everyday():
    out = []
    thread = threading.Thread(target=lambda: out.append(sum(range(10))))
    thread.start()
    thread.join()
    db = sqlite3.connect(":memory:")
    db.execute("create table t (x)")
    db.execute("insert into t values (4)")
    out.append(db.execute("select x from t").fetchone()[0])
    with tempfile.TemporaryDirectory() as folder:
        with open(os.path.join(folder, "a"), "w") as f:
            f.write("hi")
        shutil.copy2(os.path.join(folder, "a"), os.path.join(folder, "b"))
        out.append(sorted(os.listdir(folder)))
    r, w = os.pipe()
    os.write(w, b"x")
    out.append(select.select([r], [], [], 1)[0] == [r])
    time.sleep(0.01)
    signal.alarm(5)
    signal.alarm(0)
    resource.setrlimit(resource.RLIMIT_NOFILE, (32, 32))
    os.nice(1)
    out.append(len(os.urandom(4)) + len(hashlib.sha256(b"x").hexdigest()) + random.randint(0, 0))
    return out

def with_processes():
    import asyncio, multiprocessing, subprocess
    async def later():
        await asyncio.sleep(0.01)
        return 5
    with multiprocessing.get_context("fork").Pool(2) as pool:
        squares = pool.map(abs, [-1, -2])
    child = subprocess.run([sys.executable, "-c", "print(7)"], capture_output=True, text=True)
    return [asyncio.run(later()), squares, child.stdout.strip()]
"""


@ALL_MODES
def test_an_honest_program_using_the_standard_library_runs(mode: str) -> None:
    """What the seccomp allowlist must keep: threads, sqlite3 in memory, tempfile and shutil,
    select, sleep, alarm, setrlimit, nice, urandom; with a PID namespace also asyncio,
    multiprocessing and subprocess (the weak modes allow no new process)."""
    tests = ["assert everyday() == [45, 4, ['a', 'b'], True, 68]"]
    if MODES[mode].pid_namespace:
        tests.append("assert with_processes() == [5, [1, 2], '7']")
    limits = dataclasses.replace(LIMITS, timeout_s=15.0)
    result = run_tests(HONEST_STDLIB, tests, limits, MODES[mode])
    assert (result.status, result.passed) == ("ok", len(tests)), result.detail + result.output
