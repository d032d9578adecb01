"""async_rollout on the embedded tiny model: the worker process generates the next batch with the
pre-update policy, its behaviour log-probs become the old log-probs, and it never outlives a run."""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

from base_setup.backend import blas_info
from config.ppo_config import PPOConfig
from models.policy_model import PolicyModel
from ppo_trainer.callbacks import TrainerCallback
from ppo_trainer.generator import generate
from ppo_trainer.ppo_trainer import PPOTrainer
from ppo_trainer.rollout import rollout_keys
from ppo_trainer.rollout_worker import RolloutWorker, RolloutWorkerError, WorkerSpec

from tests.test_ppo_trainer import PROMPTS, e_rate
from tests.test_ppo_trainer import make_config as ppo_config
from tests.test_ppo_trainer import trainable


def make_config(tiny_model_dir: Path, run_dir: Path, **overrides: Any) -> PPOConfig:
    """test_ppo_trainer's tiny run with async rollouts, 3 steps, in ``run_dir``."""
    settings: dict[str, Any] = dict(output_dir=str(run_dir), async_rollout=True, total_steps=3)
    return ppo_config(tiny_model_dir, run_dir, **{**settings, **overrides})


class Watch(TrainerCallback):
    """Keeps, per step, the rollout (after the step), the policy's trainable weights before the
    step's update, and the worker process."""

    def __init__(self) -> None:
        self.weights_before: dict[int, dict[str, np.ndarray]] = {}
        self.rollouts: dict[int, Any] = {}
        self.processes: list[Any] = []
        self.worker_blas: list[str | None] = []

    def on_rollout_end(self, trainer: PPOTrainer, step: int, batch: Any) -> None:
        self.weights_before[step] = trainable(trainer.policy)
        worker = trainer.run.rollout_worker
        if worker is not None and worker.process not in self.processes:
            self.processes.append(worker.process)

    def on_rollout_scored(self, trainer: PPOTrainer, step: int, rollout: Any) -> None:
        self.rollouts[step] = rollout

    def on_step_end(self, trainer: PPOTrainer, step: int, metrics: dict) -> None:
        worker = trainer.run.rollout_worker
        if step == 2 and worker is not None:  # it sent its "ready" before step 2's batch
            self.worker_blas.append(worker.worker_blas)


def without_times(metrics: dict[str, float]) -> dict[str, float]:
    return {
        k: v for k, v in metrics.items() if not k.startswith("time/") and k != "tokens_per_second"
    }


@pytest.mark.slow
def test_async_run_trains_one_step_off_policy(tiny_model_dir: Path, tmp_path: Path) -> None:
    """Step 1 is the synchronous run's step 1 exactly; step 2's batch is what the policy of
    before update 1 samples from step 2's keys, and its log-probs are PPO's old log-probs; every
    trainable parameter moves; the worker is gone after train() returns."""
    sync = PPOTrainer(
        make_config(tiny_model_dir, tmp_path / "sync", async_rollout=False), reward_model=e_rate
    )
    sync_history = sync.train(PROMPTS, num_epochs=1)

    config = make_config(tiny_model_dir, tmp_path / "async")
    trainer = PPOTrainer(config, reward_model=e_rate)
    before = trainable(trainer.policy)
    watch = Watch()
    history = trainer.train(PROMPTS, num_epochs=1, callbacks=[watch])

    assert len(history) == 3
    # Equal up to summation order: a fresh async run gives the trainer half the OpenBLAS
    # threads (the worker the other half), so its matmuls may add in another order.
    assert without_times(history[0]) == pytest.approx(
        without_times(sync_history[0]), rel=1e-4, abs=1e-5
    )
    assert "time/generation_wait" in history[1]
    after = trainable(trainer.policy)
    assert not [k for k in before if np.array_equal(before[k], after[k])]

    # Step 2's responses: the weights of before update 1 (those of step 1's rollout), step 2's
    # keys, step 2's prompts, generated here again.
    rollout = watch.rollouts[2]
    trainer.policy.load_weights(
        [(k, mx.array(v)) for k, v in watch.weights_before[1].items()], strict=False
    )
    again = generate(
        trainer.policy,
        rollout.prompt_ids,
        max_new_tokens=config.max_new_tokens,
        temperature=config.temperature,
        stop_token_ids=trainer.stop_token_ids,
        pad_token_id=trainer.pad_token_id,
        return_logprobs=True,
        keys=rollout_keys(config.seed, 1, config.rollout_batch_size),
    )
    assert np.array_equal(np.array(again.responses), np.array(rollout.generation.responses))
    assert np.array_equal(np.array(again.lengths), np.array(rollout.generation.lengths))
    assert again.logprobs is not None
    np.testing.assert_allclose(np.array(again.logprobs), np.array(rollout.logprobs), atol=1e-5)
    # ... while step 2 updated the policy of after update 1: the lag is one update.
    assert any(
        not np.array_equal(watch.weights_before[1][k], watch.weights_before[2][k])
        for k in watch.weights_before[1]
    )

    assert len(watch.processes) == 1
    assert watch.worker_blas == [blas_info().name]  # its BLAS set up before mlx was imported
    assert not watch.processes[0].is_alive()
    assert not list(Path(config.output_dir).glob(".tmp-rollout-worker-*"))


@pytest.mark.slow
def test_a_dead_worker_raises_in_the_trainer(tiny_model_dir: Path, tmp_path: Path) -> None:
    class KillWorker(Watch):
        def on_step_end(self, trainer: PPOTrainer, step: int, metrics: dict) -> None:
            worker = trainer.run.rollout_worker
            assert worker is not None and worker.process.pid is not None
            os.kill(worker.process.pid, signal.SIGKILL)

    watch = KillWorker()
    trainer = PPOTrainer(make_config(tiny_model_dir, tmp_path / "run"), reward_model=e_rate)
    with pytest.raises(RolloutWorkerError, match="exited with code -9"):
        trainer.train(PROMPTS, num_epochs=1, callbacks=[watch])
    assert not watch.processes[0].is_alive()
    assert trainer.run.rollout_worker is None


@pytest.mark.slow
def test_signals_to_the_process_group_leave_the_worker_to_the_trainer(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """Ctrl-C and a scheduler's SIGTERM reach the worker too; it ignores them (the trainer
    finishes its step, saves and ends it), so the run goes on here and the worker ends with it."""

    class SignalWorker(Watch):
        def on_step_end(self, trainer: PPOTrainer, step: int, metrics: dict) -> None:
            super().on_step_end(trainer, step, metrics)
            worker = trainer.run.rollout_worker
            if step == 2 and worker is not None and worker.process.pid is not None:
                os.kill(worker.process.pid, signal.SIGINT)
                os.kill(worker.process.pid, signal.SIGTERM)

    watch = SignalWorker()
    trainer = PPOTrainer(make_config(tiny_model_dir, tmp_path / "run"), reward_model=e_rate)
    history = trainer.train(PROMPTS, num_epochs=1, callbacks=[watch])
    assert len(history) == 3
    assert watch.processes and not watch.processes[0].is_alive()


@pytest.mark.slow
def test_the_worker_ends_when_training_fails(tiny_model_dir: Path, tmp_path: Path) -> None:
    calls = []

    def failing_reward(prompts: list[str], completions: list[str]) -> list[float]:
        calls.append(1)
        if len(calls) == 3:  # step 2 (call 1 is train()'s trial call)
            raise RuntimeError("reward service down")
        return e_rate(prompts, completions)

    watch = Watch()
    trainer = PPOTrainer(make_config(tiny_model_dir, tmp_path / "run"), reward_model=failing_reward)
    with pytest.raises(RuntimeError, match="reward service down"):
        trainer.train(PROMPTS, num_epochs=1, callbacks=[watch])
    assert watch.processes and not watch.processes[0].is_alive()
    assert not list((tmp_path / "run").glob(".tmp-rollout-worker-*"))


@pytest.mark.slow
def test_a_failing_worker_sends_its_traceback(tiny_model_dir: Path, tmp_path: Path) -> None:
    """An error in the worker (here: its model cannot be loaded) is raised by the trainer's side
    with the worker's traceback, not a hang."""
    config = make_config(tiny_model_dir, tmp_path / "run")
    sampling_trainer = PPOTrainer(make_config(tiny_model_dir, tmp_path / "x"), reward_model=e_rate)
    bad = make_config(tmp_path / "no_such_model", tmp_path / "run")
    spec = WorkerSpec(bad.model_config(), sampling_trainer.sampling, 1)
    with RolloutWorker(spec, tmp_path, timeout=120) as worker:
        worker.request(
            0,
            [[5, 6, 7]],
            rollout_keys(config.seed, 0, 1),
            dict(tree_flatten(sampling_trainer.policy.trainable_parameters())),
        )
        with pytest.raises(RolloutWorkerError, match="no_such_model"):
            worker.take(0, [[5, 6, 7]])
    assert not worker.process.is_alive()


@pytest.mark.slow
def test_resume_starts_with_a_synchronous_step(
    tiny_model_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A checkpoint holds no pending batch: the resumed run generates its first step with the
    checkpoint's policy (as a synchronous run resumed there does), then goes on asynchronously.
    So it is not the uninterrupted run, and it says so (it did not, under a promise of bit-exact
    resumes)."""
    first = PPOTrainer(
        make_config(tiny_model_dir, tmp_path / "first", total_steps=4, save_every=2),
        reward_model=e_rate,
    )
    first.train(PROMPTS, num_epochs=1)
    checkpoint = tmp_path / "first" / "checkpoints" / "step_000002"
    assert checkpoint.is_dir()
    resumed = {}
    for mode in (True, False):
        config = make_config(
            tiny_model_dir, tmp_path / f"resumed_{mode}", total_steps=4, async_rollout=mode
        )
        trainer = PPOTrainer(config, reward_model=e_rate)
        caplog.clear()
        with caplog.at_level("WARNING", logger="ppo_mlx"):
            resumed[mode] = trainer.train(PROMPTS, num_epochs=1, resume_from=checkpoint)
        assert trainer.global_step == 4
        assert ("async_rollout: this resumed run is not bit for bit" in caplog.text) == mode
    assert len(resumed[True]) == 4
    assert without_times(resumed[True][2]) == without_times(resumed[False][2])


def test_async_rollout_refuses_what_it_cannot_correct(tiny_model_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="rollout_logprobs"):
        make_config(tiny_model_dir, tmp_path, rollout_logprobs="forward")
    policy = PolicyModel.from_pretrained(tiny_model_dir)
    with pytest.raises(ValueError, match="pass no policy="):
        PPOTrainer(make_config(tiny_model_dir, tmp_path), policy=policy, reward_model=e_rate)
