"""Kill a PPO run with SIGKILL again and again, resume it each time, and check that nothing is lost.

    python tests/kill_loop.py --kills 30 --out /tmp/kill_loop   (or python -m tests.kill_loop)

1. An uninterrupted reference run (``python main.py train``, a LoRA policy and a value model on
   the tiny model, a checkpoint every step, the last two kept, so every save also prunes).
2. The same run, killed ``--kills`` times with SIGKILL: half at random moments of its training
   (after the start-up: the imports and loading write nothing), half exactly inside the writes
   that matter (a checkpoint's files, the rename that publishes it, the deletion of a pruned
   one, the final model's files, the metrics file), by a child process that kills itself at the
   n-th call of that function. After every kill every listed checkpoint must be complete (each
   file's size and checksum against its manifest); the run then resumes from ``latest`` (or
   starts afresh with ``--overwrite`` when no checkpoint exists yet).
3. Every time a run finishes (the last one, and any that ends before its kill came), its final
   weights must equal the reference's, bit for bit, and its metrics must hold each step once.

The test suite runs a short version (tests/test_reliability.py); this script is the long one.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script (python tests/kill_loop.py): the packages' root
    sys.path.insert(0, str(ROOT))
STEPS = 6
#: Where a child kills itself: (module, function) patched to SIGKILL the process at its n-th call.
CRASH_POINTS: dict[str, tuple[str, str]] = {
    "checkpoint file": ("mlx.core", "save_safetensors"),
    "publish rename": ("training.checkpoint", "_replace_directory"),
    "prune": ("training.checkpoint", "_prune_one"),
    "final model": ("models.policy_model", "save_adapters"),
    "metrics line": ("training.metrics_logger", "_append_line"),
}


def length_reward(prompts: list[str], completions: list[str]) -> list[float]:
    """A deterministic reward the tiny model can move: completions' lengths, scaled."""
    return [len(c) / 20.0 for c in completions]


def _train_args(run: Path, model: Path, prompts: Path, *extra: str) -> list[str]:
    settings = {
        "model_name": str(model),
        "output_dir": str(run),
        "max_new_tokens": 8,
        "batch_size": 4,
        "num_ppo_epochs": 2,
        "num_mini_batches": 2,
        "learning_rate": 3e-3,
        "total_steps": STEPS,
        "num_epochs": 2,
        "save_every": 1,
        "keep_last_checkpoints": 2,
        "log_rollouts_every": 0,
        "progress_bar": "false",
    }
    args = ["train", "--prompts", str(prompts), "--reward-fn", "tests.kill_loop:length_reward"]
    for key, value in settings.items():
        args += ["--set", f"{key}={value}"]
    return args + list(extra)


def child_main() -> None:
    """Run ``main.py`` with the arguments after ``--``, killing this process at the n-th call of
    the function named by ``PPO_MLX_KILL_AT`` (``"<point>:<n>"``), if set."""
    from base_setup import setup_blas

    setup_blas()  # first: before mlx is imported
    crash = os.environ.get("PPO_MLX_KILL_AT")
    if crash:
        point, _, nth = crash.rpartition(":")
        module_name, attr = CRASH_POINTS[point]
        import importlib

        module = importlib.import_module(module_name)
        original = getattr(module, attr)
        calls = {"n": 0}

        def killing(*args: Any, **kwargs: Any) -> Any:
            calls["n"] += 1
            if calls["n"] == int(nth):
                if point in ("checkpoint file", "metrics line", "final model"):
                    original(*args, **kwargs)  # die with the write half done
                os.kill(os.getpid(), signal.SIGKILL)
            return original(*args, **kwargs)

        setattr(module, attr, killing)
    import main

    sys.exit(main.main(sys.argv[sys.argv.index("--") + 1 :]))


def _child_command(args: list[str]) -> list[str]:
    return [sys.executable, "-c", "import tests.kill_loop as k; k.child_main()", "--", *args]


def _run(args: list[str], env: dict[str, str], kill_after: float | None) -> int:
    process = subprocess.Popen(
        _child_command(args),
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    if kill_after is not None:
        try:
            process.wait(timeout=kill_after)
        except subprocess.TimeoutExpired:
            process.send_signal(signal.SIGKILL)
    _, err = process.communicate(timeout=600)
    if process.returncode not in (0, -signal.SIGKILL):
        raise RuntimeError(f"the run failed (exit {process.returncode}):\n{err[-3000:]}")
    return process.returncode


def _reference_run(args: list[str], env: dict[str, str], run: Path) -> tuple[float, float]:
    """Run to the end; returns the seconds until it began to train (its metrics file appeared)
    and in all: the random kills land in between, not in the imports and loading before."""
    log = run.with_name(f"{run.name}.stderr")  # a file, not a pipe: polling never drains one
    start = time.perf_counter()
    with open(log, "w") as err:
        process = subprocess.Popen(
            _child_command(args), cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=err
        )
        training_from: float | None = None
        while True:
            ended = process.poll() is not None  # looked at once more after it ended
            if training_from is None and (run / "metrics.jsonl").exists():
                training_from = time.perf_counter() - start
            if ended:
                break
            time.sleep(0.02)
    duration = time.perf_counter() - start
    if process.returncode != 0 or training_from is None:
        tail = log.read_text()[-3000:]
        raise RuntimeError(f"the reference run failed (exit {process.returncode}):\n{tail}")
    return training_from, duration


def check_complete(run: Path) -> int:
    """Every listed checkpoint complete, checksums included; returns how many there are."""
    from training.checkpoint import CheckpointManager, verify_checkpoint

    listed = CheckpointManager(run / "checkpoints").checkpoints()
    for path in listed:
        problem = verify_checkpoint(path, checksums=True)
        if problem is not None:
            raise AssertionError(f"listed checkpoint {path} is damaged: {problem}")
    return len(listed)


def final_weights(run: Path) -> dict[str, Any]:
    import numpy as np
    from safetensors.numpy import load_file

    weights = {}
    for file in sorted((run / "final").rglob("*.safetensors")):
        for name, value in load_file(str(file)).items():
            weights[f"{file.relative_to(run)}:{name}"] = np.asarray(value)
    return weights


def kill_loop(out: Path, kills: int, seed: int, random_kills: int | None = None) -> dict[str, Any]:
    """The whole procedure (see the module doc); returns what happened. ``random_kills``: how
    many of the ``kills`` come at random moments (the first ones, alternating with kills inside
    the writes; default half); the others go inside the writes, each crash point in turn."""
    at_random = (kills + 1) // 2 if random_kills is None else random_kills
    from fixtures.tiny_corpus import review_prompts
    from fixtures.tiny_model import build_tiny_checkpoint

    out.mkdir(parents=True, exist_ok=True)
    model = build_tiny_checkpoint(out / "model", size="test", seed=0)
    prompts = out / "prompts.txt"
    prompts.write_text("\n".join(review_prompts(16, seed=0)) + "\n")
    # One BLAS thread in every run: two runs started separately must not pick different thread
    # counts from the load at their starts (a resumed run takes its checkpoint's count anyway),
    # and the tiny model's matmuls gain nothing from a second thread, which only spins while the
    # test suite's other worker holds the other core (a fifth of the loop's time).
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "OPENBLAS_NUM_THREADS": "1",
        "PPO_MLX_ADAPTIVE_BLAS": "off",  # no quarter-second load measurement at each start
    }
    env.pop("PPO_MLX_KILL_AT", None)

    reference = out / "reference"
    shutil.rmtree(reference, ignore_errors=True)
    training_from, duration = _reference_run(_train_args(reference, model, prompts), env, reference)

    rng = random.Random(seed)
    run = out / "run"
    shutil.rmtree(run, ignore_errors=True)
    done = finished = random_done = 0
    log: list[str] = []
    while True:
        has_checkpoint = check_complete(run) > 0 if run.exists() else False
        extra = ["--resume", "latest"] if has_checkpoint else ["--overwrite"]
        child_env = dict(env)
        kill_after: float | None = None
        if done < kills:
            inside_done = done - random_done
            at_random_now = random_done <= inside_done or inside_done >= kills - at_random
            if random_done < at_random and at_random_now:
                kill_after = rng.uniform(training_from, duration)
                how = f"at {kill_after:.1f} s"
            else:
                # Each crash point in turn; the final model is written once per run.
                point = sorted(CRASH_POINTS)[inside_done % len(CRASH_POINTS)]
                nth = 1 if point == "final model" else rng.randint(1, 3)
                child_env["PPO_MLX_KILL_AT"] = f"{point}:{nth}"
                how = f"inside {child_env['PPO_MLX_KILL_AT']}"
        else:
            how = "to the end"
        code = _run(_train_args(run, model, prompts, *extra), child_env, kill_after)
        listed = check_complete(run)
        log.append(f"{'resume' if has_checkpoint else 'fresh'} {how}: exit {code}, {listed} listed")
        if code == 0:
            # Every finished run, not only the last: the same weights and metrics as the
            # uninterrupted one.
            check_finished(run, reference)
            finished += 1
            if done >= kills:
                break
            # The run ended before the kill came: begin the next round afresh (a finished run
            # has nothing left to resume); the kills still to do come in the new round.
            shutil.rmtree(run)
        else:
            done += 1
            random_done += kill_after is not None
    return {"kills": done, "finished": finished, "log": log}


def check_finished(run: Path, reference: Path) -> None:
    """A finished run's final weights are the uninterrupted run's, bit for bit, and its metrics
    hold each step once."""
    import numpy as np

    assert (run / "final").is_dir(), f"{run} exited 0 without a final model"
    ours, theirs = final_weights(run), final_weights(reference)
    assert ours.keys() == theirs.keys(), (sorted(ours), sorted(theirs))
    different = [k for k in ours if not np.array_equal(ours[k], theirs[k])]
    assert not different, f"final weights differ from the uninterrupted run: {different[:5]}"
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, STEPS + 1)), steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kills", type=int, default=30, help="SIGKILLs before the last resume")
    parser.add_argument("--out", default="runs/kill_loop", help="working folder")
    parser.add_argument("--seed", type=int, default=0, help="seed of the kill moments")
    args = parser.parse_args()
    result = kill_loop(Path(args.out), args.kills, args.seed)
    print("\n".join(result["log"]))
    print(
        f"{result['kills']} kills, {result['finished']} finished runs; every listed checkpoint "
        "complete; every finished run's final weights identical to the uninterrupted run's"
    )


if __name__ == "__main__":
    main()
