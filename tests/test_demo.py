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
    assert "BLAS: " not in first.stderr  # a working BLAS is said at debug level only (-v)
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


USER_REWARDS = """
def brevity(completions, **kwargs):
    return [-float(len(c.split())) for c in completions]

def needs_solution(completions, solution):
    return [0.0] * len(completions)
"""


@pytest.mark.slow
@pytest.mark.parametrize("spec", ["rewards:brevity", "rewards.py:brevity", "config:brevity"])
def test_cli_loads_the_users_reward_file_from_the_working_directory(
    tmp_path: Path, spec: str
) -> None:
    # `config` is also one of this project's packages: the user's config.py must win.
    (tmp_path / f"{spec.split(':')[0].removesuffix('.py')}.py").write_text(USER_REWARDS)
    (tmp_path / "prompts.txt").write_text("Review of the lamp:\n")
    # main.py run by path from another directory: like the installed `ppo-mlx`, the working
    # directory is not on sys.path.
    command = [sys.executable, str(ROOT / "main.py"), "train", "--prompts", "prompts.txt"]
    command += ["--set", f"model_name={tmp_path / 'no-model'}", "--set", "output_dir=run"]
    result = subprocess.run(
        command + ["--reward-fn", spec], cwd=tmp_path, capture_output=True, text=True, timeout=300
    )
    loaded = f"reward function brevity from {tmp_path.resolve() / spec.split(':')[0]}"
    assert loaded.removesuffix(".py") + ".py" in result.stderr, result.stderr[-2000:]
    assert "no-model" in result.stderr and result.returncode == 2  # it got as far as the model
    if spec != "rewards.py:brevity":
        return
    needs = command + ["--reward-fn", spec.replace("brevity", "needs_solution")]
    result = subprocess.run(needs, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert result.returncode == 2
    assert "needs_solution needs the column(s) ['solution']" in result.stderr
    assert "no-model" not in result.stderr  # checked before the model loads


def test_load_function_names_what_is_wrong(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from ppo_trainer.components import load_function

    monkeypatch.chdir(tmp_path)
    with pytest.raises(
        ValueError, match="cannot import nowhere_module .*path/to/nowhere_module.py"
    ):
        load_function("nowhere_module:f")
    with pytest.raises(ValueError, match="there is no file"):
        load_function("missing.py:f")
    with pytest.raises(ValueError, match="must look like"):
        load_function("rewards")
    (tmp_path / "mine.py").write_text("x = 1\n")
    with pytest.raises(ValueError, match="f is not a function in .*it defines no public function"):
        load_function("mine:f")
    (tmp_path / "scores.py").write_text(
        "from math import sqrt\n\ndef brevity(completions, **kw):\n    return [0.0]\n\n"
        "def polite(completions, **kw):\n    return [0.0]\n\ndef _helper():\n    pass\n"
    )
    with pytest.raises(
        ValueError, match="did you mean 'brevity'\\? its functions: brevity, polite$"
    ):
        load_function("scores.py:brevty")
    # a module the import system finds at the same file is imported as usual
    assert load_function("json:dumps") is __import__("json").dumps


def test_help_is_quiet_and_a_missing_model_names_the_flag(tmp_path: Path) -> None:
    help_run = run_main("--help")
    assert help_run.returncode == 0 and "BLAS: " not in help_run.stdout + help_run.stderr
    (tmp_path / "prompts.txt").write_text("Review of the lamp:\n")
    missing = run_main("train", "--prompts", str(tmp_path / "prompts.txt"))
    assert missing.returncode == 2 and "BLAS: " not in missing.stderr
    assert "--set model_name=..." in missing.stderr
    verbose = run_main("-v", "config")
    assert "BLAS: " in verbose.stderr  # said when asked for


@pytest.mark.slow
def test_evaluate_leaves_no_empty_run_folder(tiny_model_dir: Path, tmp_path: Path) -> None:
    (tmp_path / "prompts.txt").write_text("Review of the lamp:\nReview of the park:\n")
    (tmp_path / "rewards.py").write_text(USER_REWARDS)
    command = [sys.executable, str(ROOT / "main.py"), "evaluate", "--prompts", "prompts.txt"]
    command += ["--reward-fn", "rewards:brevity"]
    command += ["--set", f"model_name={tiny_model_dir}", "--set", "max_new_tokens=4"]
    command += ["--set", "output_dir=runs/eval", "--samples", "1"]
    result = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert '"eval/mean_reward"' in result.stdout
    assert not (tmp_path / "runs" / "eval").exists()
