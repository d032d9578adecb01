"""base_setup.jit_header: the precompiled header MLX's CPU kernel compiler (g++) picks up."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from base_setup import jit_header
from base_setup.jit_header import compile_flags, header_path, prepare_jit_header, temp_directory

REPO = Path(__file__).resolve().parents[1]
needs_gcc = pytest.mark.skipif(
    not sys.platform.startswith("linux")
    or shutil.which("g++") is None
    or jit_header._mlx_paths() is None,
    reason="Linux with g++ and an MLX that ships its headers",
)


def test_compile_flags_only_of_a_command_of_the_known_shape() -> None:
    mlx_0_32 = 'g++ -std=c++17 -O3 -Wall -fPIC -shared {} "{}" -o "{}" 2>&1'
    assert compile_flags(mlx_0_32) == ["g++", "-std=c++17", "-O3", "-Wall", "-fPIC"]
    avx2 = 'g++ -std=c++17 -O3 -fPIC -shared -mavx2 -mfma {} "{}" -o "{}" 2>&1'
    assert compile_flags(avx2) == ["g++", "-std=c++17", "-O3", "-fPIC", "-mavx2", "-mfma"]
    for other in (
        'clang++ -O3 -shared {} "{}" -o "{}" 2>&1',  # not g++
        'g++ -O3 -shared {} "{}" -o "{}" -march=native 2>&1',  # a flag the header would miss
        'g++ -O3 -shared "{0}" -o "{1}" 2>&1',  # no include flags: the preamble is inline
        "g++ -O3 -shared file.cpp -o file.so",  # not a format
    ):
        assert compile_flags(other) is None, other


def test_mlx_root_is_the_wheels_folder_whatever_else_is_named_mlx(tmp_path: Path) -> None:
    """A folder named ``mlx`` before the wheel's on ``sys.path`` (MLX's kernel cache ``/tmp/mlx``
    for a script run from ``/tmp``) is a location of the namespace package too, and not MLX."""
    wheel = jit_header.mlx_root()
    if wheel is None:
        pytest.skip("no mlx wheel with lib/libmlx.so")
    (tmp_path / "mlx").mkdir()
    probe = "from base_setup import jit_header; print(jit_header.mlx_root())"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(REPO)])}
    done = subprocess.run(
        [sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True
    )
    assert done.stdout.strip() == str(wheel)
    found = subprocess.run(
        [sys.executable, "-c", "import mlx; print(list(mlx.__path__)[0])"],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    assert found.stdout.strip() == str(tmp_path / "mlx")  # the trap is real


def test_temp_directory_is_cpps(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("TMPDIR", "TMP", "TEMP", "TEMPDIR"):
        monkeypatch.delenv(name, raising=False)
    assert temp_directory() == Path("/tmp")
    monkeypatch.setenv("TEMP", "/b")
    assert temp_directory() == Path("/b")
    monkeypatch.setenv("TMPDIR", "/a")
    assert temp_directory() == Path("/a")
    assert header_path("0.32.4") == Path("/a/mlx/0.32.4/cpu/" + jit_header.PREAMBLE + ".gch")


@needs_gcc
def test_turned_off_or_being_built_elsewhere_it_does_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setenv("PPO_MLX_JIT_HEADER", "0")
    assert prepare_jit_header() is None
    assert not (tmp_path / "mlx").exists()
    monkeypatch.setenv("PPO_MLX_JIT_HEADER", "maybe")
    with pytest.raises(ValueError, match="PPO_MLX_JIT_HEADER='maybe' is not a setting"):
        prepare_jit_header()
    monkeypatch.delenv("PPO_MLX_JIT_HEADER")
    found = jit_header._mlx_paths()
    assert found is not None
    target = header_path(found[2])
    lock = target.with_name(target.name + ".lock")
    lock.parent.mkdir(parents=True)
    lock.write_text("12345")  # another process started a build a moment ago
    assert prepare_jit_header() is None
    assert not target.exists() and lock.read_text() == "12345"


@needs_gcc
def test_a_failed_build_raises_when_waited_for_and_leaves_nothing_behind(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    bad = 'g++ -std=c++17 --no-such-flag -shared {} "{}" -o "{}"'
    monkeypatch.setattr(jit_header, "mlx_command_format", lambda libmlx: bad)
    with pytest.raises(OSError, match="failed: .*no-such-flag"):
        prepare_jit_header(wait=True)
    folder = next((tmp_path / "mlx").rglob("cpu/mlx/backend/cpu"))
    # No lock, no half-written header, no stamp: only the note that it failed with this g++ and
    # MLX, so that the next programs do not start the same build again.
    assert [p.name for p in folder.iterdir()] == ["compiled_preamble.h.gch.failed"]
    assert prepare_jit_header() is None
    assert [p.name for p in folder.iterdir()] == ["compiled_preamble.h.gch.failed"]
    assert not list(folder.parents[2].glob("jit-header-build-*"))


@needs_gcc
def test_mlx_builds_its_kernels_with_the_header_built_in_the_background(tmp_path: Path) -> None:
    """In a fresh temp directory: the background build (taking over a stale lock) leaves the
    header and its stamp; MLX's own g++ command then loads it (a g++ on PATH that logs ``-H``
    shows "! <header>.gch": used), and a second call finds it current and builds nothing."""
    found = jit_header._mlx_paths()
    assert found is not None
    temp, bin_dir, log = tmp_path / "tmp", tmp_path / "bin", tmp_path / "g++.log"
    bin_dir.mkdir()
    wrapper = bin_dir / "g++"
    wrapper.write_text(  # g++ -H, its stderr copied to the log
        f'#!/bin/sh\nerr=$(mktemp)\n{shutil.which("g++")} -H "$@" 2>"$err"\nrc=$?\n'
        f'cat "$err" >>{log}\ncat "$err" >&2\nrm -f "$err"\nexit $rc\n'
    )
    wrapper.chmod(0o755)
    env = {**os.environ, "TMPDIR": str(temp), "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    env.pop("PPO_MLX_JIT_HEADER", None)
    target = temp / "mlx" / found[2] / "cpu" / (jit_header.PREAMBLE + ".gch")
    lock = target.with_name(target.name + ".lock")
    lock.parent.mkdir(parents=True)
    lock.write_text("1")
    os.utime(lock, (time.time() - 2 * jit_header.STALE_LOCK_S,) * 2)  # left by a killed build

    def run(code: str) -> str:
        done = subprocess.run(
            [sys.executable, "-c", textwrap.dedent(code)],
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert done.returncode == 0, done.stderr[-3000:]
        return done.stdout

    prepare = "from base_setup.jit_header import prepare_jit_header; print(prepare_jit_header())"
    assert run(prepare).strip() == str(target)
    stamp = target.with_name(target.name + ".stamp")
    deadline = time.monotonic() + 240
    while lock.exists() and time.monotonic() < deadline:  # the build ends by removing it
        time.sleep(0.2)
    assert stamp.is_file() and target.stat().st_size > 1_000_000 and not lock.exists()
    built = target.stat().st_mtime_ns
    log.unlink()
    out = run("""
        import mlx.core as mx
        f = mx.compile(lambda x: x * 2.5 + 1.0)
        print(f(mx.arange(4, dtype=mx.float32)).tolist())
        """)
    assert out.strip() == "[1.0, 3.5, 6.0, 8.5]"
    assert list((target.parents[3]).glob("lib*.so"))  # MLX built the kernel in that folder
    assert f"! {target}" in log.read_text()  # and g++ loaded the precompiled header
    assert run(prepare).strip() == str(target)  # current: nothing rebuilt
    assert target.stat().st_mtime_ns == built and not lock.exists()
