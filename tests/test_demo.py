"""`python main.py demo` end to end (at smoke scale), and the command line's error handling."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def run_main(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "main.py", *args], cwd=ROOT, capture_output=True, text=True, timeout=600
    )


@pytest.mark.slow
def test_demo_runs_every_stage_and_reuses_cached_stages(tmp_path: Path) -> None:
    out = tmp_path / "demo"
    first = run_main("demo", "--smoke", "--output-dir", str(out))
    assert first.returncode == 0, first.stderr[-3000:]
    for marker in (
        "[SFT] done",
        "[reward model] done",
        "held-out accuracy",
        "Before PPO",
        "After PPO",
    ):
        assert marker in first.stdout, marker
    assert "BLAS: " in first.stderr  # the backend says which BLAS it uses
    assert (out / "ppo" / "metrics.jsonl").read_text().count("\n") == 2
    assert (out / "ppo" / "training_curves.png").stat().st_size > 10_000
    assert (out / "ppo" / "final" / "adapters.safetensors").is_file()
    second = run_main("demo", "--smoke", "--output-dir", str(out))
    assert second.returncode == 0, second.stderr[-3000:]
    assert "[SFT] reusing the cached result" in second.stdout
    assert "[reward model] reusing the cached result" in second.stdout


def test_cli_reports_bad_input_clearly(tmp_path: Path) -> None:
    bad = tmp_path / "prompts.jsonl"
    bad.write_text('{"prompt": "ok"}\n{not json}\n')
    result = run_main("train", "--prompts", str(bad), "--set", "model_name=x")
    assert result.returncode == 2
    assert f"{bad}:2" in result.stderr
    good = tmp_path / "prompts.txt"
    good.write_text("Review of the lamp:\n")
    unknown = run_main("train", "--prompts", str(good), "--set", "learning_rat=1e-3")
    assert unknown.returncode == 2 and "learning_rate" in unknown.stderr
