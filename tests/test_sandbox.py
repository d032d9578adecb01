"""The code sandbox: honest scores, and hostile completions that score 0 (or their honest result),
end within bounded time and leave no process, file or directory behind.

Wall-time bounds below are hang guards (timeout + 10 s), not speed assertions.
"""

import os
import secrets
import socket
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import pytest

from sandbox import (
    WORKDIR_PREFIX,
    Isolation,
    SandboxLimits,
    TestResult,
    detect_isolation,
    extract_code,
    probe_isolation,
    run_tests,
    run_tests_many,
    score_completions,
)
from sandbox import isolation as sandbox_host

pytestmark = pytest.mark.skipif(os.name != "posix", reason="the sandbox needs a POSIX system")

FALLBACK = Isolation(
    separate_uid=False,
    network_namespace=False,
    private_mounts=False,
    pid_namespace=False,
    audit_hook=True,
)
ISOLATION = detect_isolation() if os.name == "posix" else FALLBACK
LINUX = sys.platform.startswith("linux")
REPO = Path(__file__).resolve().parents[1]

# isolation="weak" lets the FALLBACK (audit hook only) runs below run; the detected isolation is
# strong wherever the machine allows it (tests/test_sandbox_hostile.py checks the refusal).
LIMITS = SandboxLimits(timeout_s=1.5, cpu_time_s=3, memory_mb=256, isolation="weak")
GOOD = "def f(x):\n    return 2 * x\n"
TESTS = ["assert f(2) == 4", "assert f(0) == 0"]


def _has_cap_sys_admin() -> bool:
    with open("/proc/self/status") as f:
        caps = next(line for line in f if line.startswith("CapEff:"))
    return bool(int(caps.split()[1], 16) & (1 << 21))


def _processes_of(uids: Iterable[int]) -> list[str]:
    """Live (non-zombie) processes running as one of ``uids`` (Linux)."""
    wanted = {str(uid) for uid in uids}
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            status = Path(f"/proc/{pid}/status").read_text()
        except (FileNotFoundError, ProcessLookupError):
            continue
        fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
        if wanted & set(fields["Uid"].split()) and not fields["State"].strip().startswith("Z"):
            found.append(f"{pid} {fields['Name'].strip()} {fields['State'].strip()}")
    return found


_used_uids: list[int] = []  # every sandbox uid this test session picked


@pytest.fixture(autouse=True)
def record_sandbox_uids(monkeypatch: pytest.MonkeyPatch) -> None:
    """Spy on the uid picker, so that leftover checks look at this session's sandboxes only
    (another test session may be running sandboxes at the same time)."""
    pick = sandbox_host.pick_uid

    def recording_pick() -> int:
        uid = pick()
        _used_uids.append(uid)
        return uid

    monkeypatch.setattr(sandbox_host, "pick_uid", recording_pick)


def _sandbox_processes() -> list[str]:
    """Live processes of any sandbox uid this session used."""
    return _processes_of(_used_uids)


def _host_workdirs() -> list[str]:
    return sorted(p for p in os.listdir(tempfile.gettempdir()) if p.startswith(WORKDIR_PREFIX))


def checked_run(
    code: str,
    tests: list[str],
    limits: SandboxLimits = LIMITS,
    isolation: Isolation | None = None,
) -> TestResult:
    """run_tests, then check it ended in bounded time and left no directory or process behind."""
    start = time.monotonic()
    result = run_tests(code, tests, limits, isolation)
    elapsed = time.monotonic() - start
    # A hang guard, not a speed test: generous for a busy machine (a hang is the 300 s sleeps).
    assert elapsed < limits.timeout_s + 60.0, f"hang guard: {elapsed:.1f} s"
    assert _host_workdirs() == []
    if LINUX and (isolation or ISOLATION).separate_uid:
        assert _sandbox_processes() == []
    assert 0.0 <= result.fraction <= 1.0
    return result


def test_honest_solution_passes_every_test() -> None:
    code = GOOD + "print('hello')\nif __name__ == '__main__':\n    input()\n"
    result = checked_run(code, TESTS)
    assert (result.status, result.passed, result.total, result.fraction) == ("ok", 2, 2, 1.0)
    assert result.output == "hello\n"


def test_partly_wrong_solution_gets_its_honest_fraction() -> None:
    code = "def f(x):\n    return 4 if x == 2 else x\n"
    tests = [
        "assert f(2) == 4",
        "assert f(3) == 6",
        "raise ValueError('boom')\nassert f(0) == 0",  # statements before an assert
        "assert f(0) == 0",
    ]
    result = checked_run(code, tests)
    assert (result.status, result.passed, result.total) == ("ok", 2, 4)
    assert result.fraction == 0.5
    assert "test 1: assert f(3) == 6: f(3) gave 3" in result.detail
    assert "test 2: ValueError: boom" in result.detail


def test_tests_share_the_namespace_and_exit_inside_a_test_only_fails_that_test() -> None:
    tests = ["assert f(1) == 2", "import sys; sys.exit(0)\nassert f(2) == 4", "assert f(3) == 6"]
    result = checked_run(GOOD + "calls = []\n", tests)
    assert (result.status, result.passed) == ("ok", 2)
    assert "test 1: SystemExit" in result.detail


HOSTILE_ZERO = {
    "infinite loop": ("while True:\n    pass\n" + GOOD, "timeout"),
    "fork bomb": (
        "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n",
        "timeout",
    ),
    "10 GB allocation": ("block = bytearray(10 * 1024**3)\n" + GOOD, "error"),
    "sys.exit before the tests": ("import sys\nsys.exit(0)\n" + GOOD, "error"),
    "os._exit before the tests": (GOOD + "import os\nos._exit(0)\n", "crashed"),
    "syntax error": ("def f(x) return x\n", "error"),
    "file past the size limit": ("open('big', 'wb').write(b'x' * 3 * 2**20)\n" + GOOD, "error"),
    "fake results on stdout and the result pipe": (
        GOOD + "import os\nprint('0 value 0 0 4\\n0 value 1 0 0\\n0 done -1 -1 ')\n"
        "for fd in range(3, 10):\n    try:\n        os.write(fd, b'0 value 0 0 4\\n0 value 1 0 0\\n')\n"
        "    except OSError:\n        pass\nos._exit(0)\n",
        "crashed",
    ),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(HOSTILE_ZERO))
def test_hostile_completion_scores_zero(name: str) -> None:
    code, status = HOSTILE_ZERO[name]
    result = checked_run(code, TESTS)
    assert (result.status, result.passed) == (status, 0), result.detail


@pytest.mark.slow
def test_cpu_limit_kills_a_busy_loop_before_the_wall_clock() -> None:
    limits = SandboxLimits(timeout_s=20.0, cpu_time_s=1)
    result = checked_run("while True:\n    pass\n", TESTS, limits)
    assert result.status == "crashed"
    assert "SIGXCPU" in result.detail or "SIGKILL" in result.detail


def test_passes_before_a_timeout_or_crash_still_count() -> None:
    loop = "while True: pass\nassert f(0) == 0"
    looping = checked_run(GOOD, ["assert f(1) == 2", loop, "assert f(2) == 4"])
    assert (looping.status, looping.passed, looping.total) == ("timeout", 1, 3)
    exit_3 = "import os; os._exit(3)\nassert f(0) == 0"
    exiting = checked_run(GOOD, ["assert f(1) == 2", exit_3, "assert f(2) == 4"])
    assert (exiting.status, exiting.passed) == ("crashed", 1)
    assert "exit code 3" in exiting.detail


def test_memory_limit_fails_only_the_test_that_allocates() -> None:
    result = checked_run(GOOD, ["assert len(bytearray(10 * 1024**3)) == 0", "assert f(2) == 4"])
    assert (result.status, result.passed) == ("ok", 1)
    assert "MemoryError" in result.detail


def test_megabytes_of_output_are_capped_and_do_not_block() -> None:
    limits = SandboxLimits(timeout_s=10.0, max_output_bytes=1000)
    code = "import sys\nfor _ in range(20):\n    print('x' * 10**6)\n    sys.stderr.write('y' * 10**5)\n"
    result = checked_run(code + GOOD, TESTS, limits)
    assert (result.status, result.fraction) == ("ok", 1.0)
    assert len(result.output) == 1000
    assert "output bytes past the 1000 cap dropped" in result.detail


@pytest.mark.parametrize("isolation", [None, FALLBACK], ids=["detected", "audit_hook"])
def test_the_trainer_cannot_be_signalled(isolation: Isolation | None) -> None:
    # Signal 0 only checks permission; a SIGKILL that got through would end this test session.
    code = (
        f"import os\ntry:\n    os.kill({os.getpid()}, 0)\n    allowed = True\n"
        "except OSError:\n    allowed = False\n" + GOOD
    )
    result = checked_run(code, ["assert not allowed", *TESTS], LIMITS, isolation)
    assert (result.status, result.passed) == ("ok", 3), result.detail


@pytest.mark.skipif(
    not ISOLATION.separate_uid, reason="needs root to run candidates as a fresh uid"
)
def test_sigkill_to_the_trainer_its_parent_and_everyone_is_harmless() -> None:
    code = f"import os, signal\nos.kill({os.getpid()}, signal.SIGKILL)\n" + GOOD
    assert checked_run(code, TESTS).status == "error"
    code = "import os, signal\n" + "".join(
        f"try:\n    os.kill({target}, signal.SIGKILL)\nexcept OSError:\n    pass\n"
        for target in ("os.getppid()", "1", "-1")
    )
    assert checked_run(code + GOOD, TESTS).fraction == 1.0


@pytest.mark.skipif(
    not (LINUX and ISOLATION.separate_uid and not ISOLATION.audit_hook),
    reason="needs a fresh uid on Linux, without the audit hook (which blocks fork)",
)
def test_escaped_daemons_are_killed() -> None:
    code = (
        "import os, time\nfor _ in range(3):\n    if os.fork() == 0:\n        os.setsid()\n"
        "        if os.fork() == 0:\n            time.sleep(300)\n        os._exit(0)\n" + GOOD
    )
    result = checked_run(code, TESTS)  # checks that no process of the sandbox uid is left
    assert result.fraction == 1.0


def _poll(condition: Callable[[], bool], limit_s: float = 15.0) -> bool:
    """Wait until ``condition()`` holds (True) or ``limit_s`` passes (False); a hang guard."""
    deadline = time.monotonic() + limit_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


@pytest.mark.skipif(
    not (LINUX and ISOLATION.pid_namespace), reason="needs the Linux PID namespace layer (root)"
)
def test_killing_the_trainer_kills_its_sandboxes() -> None:
    candidate = (
        "import os, time\nfor _ in range(2):\n    if os.fork() == 0:\n        os.setsid()\n"
        "        time.sleep(300)\nwhile True:\n    time.sleep(1)\n"
    )
    trainer = (  # a stand-in trainer that prints the sandbox uid it picks
        "import sandbox\nfrom sandbox import isolation as host\npick = host.pick_uid\n"
        "def spy():\n    uid = pick()\n    print(uid, flush=True)\n    return uid\n"
        "host.pick_uid = spy\n"
        f"sandbox.run_tests({candidate!r}, ['assert len([]) == 0'], "
        "sandbox.SandboxLimits(timeout_s=60.0), sandbox.Isolation(True, True, True, True, False))\n"
    )
    process = subprocess.Popen(
        [sys.executable, "-c", trainer], stdout=subprocess.PIPE, text=True, cwd=REPO
    )
    try:
        assert process.stdout is not None
        uid = int(process.stdout.readline())
        assert _poll(lambda: len(_processes_of([uid])) >= 3), "the sandbox never started"
    finally:
        process.kill()
        process.wait()
    assert _poll(lambda: _processes_of([uid]) == []), _processes_of([uid])


@pytest.fixture
def sentinel_dir() -> Iterator[Path]:
    directory = Path(tempfile.mkdtemp(prefix="sandbox_sentinel_"))
    directory.chmod(0o755)
    (directory / "sentinel.txt").write_text("keep me")
    (directory / "sentinel.txt").chmod(0o644)
    yield directory
    for child in directory.iterdir():
        child.unlink()
    directory.rmdir()


@pytest.fixture
def world_writable_dir() -> Iterator[Path]:
    """A mode-0777 directory outside /tmp (which the strongest mode replaces by its own)."""
    directory = REPO / f".sandbox_world_writable_{secrets.token_hex(6)}"
    directory.mkdir()
    directory.chmod(0o777)
    yield directory
    for child in directory.iterdir():
        child.unlink()
    directory.rmdir()


@pytest.mark.parametrize("isolation", [None, FALLBACK], ids=["detected", "audit_hook"])
def test_files_outside_its_directory_are_untouched(
    isolation: Isolation | None, sentinel_dir: Path, world_writable_dir: Path
) -> None:
    tag = secrets.token_hex(6)
    escapes = [f"/tmp/escape_{tag}", str(REPO / f"escape_{tag}"), str(sentinel_dir / "new.txt")]
    escapes.append(str(world_writable_dir / "new.txt"))
    sentinel = sentinel_dir / "sentinel.txt"
    attempts = [
        f"os.remove({str(sentinel)!r})",
        f"open({str(sentinel)!r}, 'w').write('gone')",
        f"os.chmod({str(sentinel_dir)!r}, 0o777)",
        f"shutil.rmtree({str(sentinel_dir)!r})",
        *(f"open({path!r}, 'w').write('x')" for path in escapes),
        "open('inside.txt', 'w').write('mine')",  # its own directory: allowed
    ]
    code = "import os, shutil\ndone = []\n" + "".join(
        f"try:\n    {a}\n    done.append({a!r})\nexcept OSError:\n    pass\n" for a in attempts
    )
    tests = [
        "assert open('inside.txt').read() == 'mine'",
        "assert [d for d in done if d.startswith('os.remove')] == []",
    ]
    result = checked_run(code + GOOD, tests, LIMITS, isolation)
    assert (result.status, result.passed) == ("ok", 2), result.detail
    assert sentinel.read_text() == "keep me"
    assert stat.S_IMODE(sentinel_dir.stat().st_mode) == 0o755
    assert sorted(p.name for p in sentinel_dir.iterdir()) == ["sentinel.txt"]
    assert not any(os.path.exists(path) for path in escapes)


@pytest.mark.parametrize("isolation", [None, FALLBACK], ids=["detected", "audit_hook"])
def test_network_connections_fail(isolation: Isolation | None) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as server:
        server.bind(("127.0.0.1", 0))
        server.listen(4)
        server.setblocking(False)
        port = server.getsockname()[1]
        code = (
            "try:\n    import socket\n"
            f"    socket.create_connection(('127.0.0.1', {port}), timeout=1).close()\n"
            "    connected = True\nexcept (OSError, ImportError):\n    connected = False\n" + GOOD
        )
        result = checked_run(code, ["assert connected is False", *TESTS], LIMITS, isolation)
        assert (result.status, result.passed) == ("ok", 3), result.detail
        with pytest.raises(BlockingIOError):
            server.accept()  # nothing ever connected


def test_fork_is_blocked_by_the_fallback_audit_hook() -> None:
    code = "import os\ntry:\n    os.fork() or os._exit(0)\n    forked = True\nexcept PermissionError:\n    forked = False\n"
    result = checked_run(code + GOOD, ["assert forked is False"], LIMITS, FALLBACK)
    assert (result.status, result.passed) == ("ok", 1), result.detail


@pytest.mark.slow
def test_parallel_scoring_of_mixed_completions() -> None:
    kinds = {
        "honest": (GOOD, 1.0),
        "partial": ("def f(x):\n    return 4\n", 0.5),
        "loop": ("while True:\n    pass\n", 0.0),
        "exit": ("import sys\nsys.exit(0)\n" + GOOD, 0.0),
        "alloc": ("block = bytearray(10 * 1024**3)\n" + GOOD, 0.0),
        "flood": ("for _ in range(10):\n    print('z' * 10**6)\n" + GOOD, 1.0),
        "kill": (f"import os, signal\nos.kill({os.getpid()}, signal.SIGKILL)\n" + GOOD, 0.0),
        "crash": ("import os\nos._exit(1)\n", 0.0),
    }
    order = ["honest", "loop", "partial", "exit", "honest", "alloc", "flood", "partial"]
    order += ["kill", "honest", "crash", "flood", "partial", "honest", "loop", "honest"]
    codes = [kinds[k][0] for k in order]
    # The loops end on their CPU time (1 s of it whatever the load), not on the wall clock: a
    # busy machine must not time out the honest completions (10 MB of output takes a while).
    limits = SandboxLimits(timeout_s=20.0, cpu_time_s=1, memory_mb=256)
    scores = score_completions(codes, [TESTS] * len(codes), limits, max_workers=4)
    assert scores == [kinds[k][1] for k in order]
    assert _host_workdirs() == []
    if LINUX and ISOLATION.separate_uid:
        assert _sandbox_processes() == []
    # The wall clock's own verdict: the loop outlives 3 s (its CPU limit is far), the others
    # end in a fraction of that even on a busy machine.
    limits = SandboxLimits(timeout_s=3.0, cpu_time_s=60, memory_mb=256)
    results = run_tests_many(codes[:3], [TESTS] * 3, limits, max_workers=2)
    assert [r.status for r in results] == ["ok", "timeout", "ok"]


@pytest.mark.skipif(
    not (LINUX and os.geteuid() == 0 and _has_cap_sys_admin()),
    reason="the full isolation needs root with CAP_SYS_ADMIN on Linux",
)
def test_linux_root_gets_every_kernel_layer() -> None:
    landlock = ISOLATION.landlock  # where the kernel has it
    assert ISOLATION == Isolation(True, True, True, True, False, seccomp=True, landlock=landlock)
    code = "import os\nuid = os.getuid()\ncwd = os.getcwd()\n"
    code += "pids = sorted(int(p) for p in os.listdir('/proc') if p.isdigit())\n"
    tests = ["assert uid >= 1000", "assert cwd == '/tmp/sandbox'", "assert pids == [1, 2]"]
    result = checked_run(code, tests)
    assert result.fraction == 1.0, result.detail
    assert probe_isolation(FALLBACK) is None


def test_extract_code() -> None:
    assert extract_code("Here:\n```python\ndef f():\n    return 1\n```\nDone.") == (
        "def f():\n    return 1"
    )
    assert extract_code("```bash\nls\n```\n```py\nx = 1\n```") == "x = 1"
    assert extract_code("```\ny = 2\n```\n```python3\nz = 3\n```") == "z = 3"
    assert extract_code("```\ny = 2\n```") == "y = 2"
    assert extract_code("```python\ndef g():\n    pass") == "def g():\n    pass"  # cut off
    assert extract_code("  def h(): pass\n") == "def h(): pass"


def test_bad_inputs_raise_value_error() -> None:
    with pytest.raises(ValueError, match="non-empty"):
        run_tests(GOOD, [])
    with pytest.raises(ValueError, match=r"tests\[1\] does not compile"):
        run_tests(GOOD, ["assert f(1) == 2", "assert ("])
    with pytest.raises(ValueError, match="same length"):
        score_completions([GOOD, GOOD], [TESTS])
    with pytest.raises(ValueError, match="memory_mb"):
        SandboxLimits(memory_mb=8)
    with pytest.raises(ValueError, match="private_mounts needs separate_uid"):
        Isolation(False, True, True, False, False)
    with pytest.raises(ValueError, match="pid_namespace needs private_mounts"):
        Isolation(True, True, False, True, False)
