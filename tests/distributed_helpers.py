"""What tests/test_distributed.py runs on every rank of an ``mlx.launch``'ed job.

* :func:`letter_rate`: the reward function of the training runs (``--reward-fn
  tests.distributed_helpers:letter_rate``); it reads a column of the prompt records, so the
  ranks' shares of the columns are checked along with their shares of the prompts.
* ``python -m tests.distributed_helpers train DUMP_DIR STOP_STEP -- <main.py train arguments>``:
  ``main.py train`` stopped after ``STOP_STEP`` steps, then resumed with ``--resume latest`` to the
  end; at the end each rank saves its final trainable weights to ``DUMP_DIR/rank<r>.safetensors``
  (a test hook: the one extra callback, so that the test can compare the ranks' weights).
* ``python -m tests.distributed_helpers stages DUMP_DIR RUNS_JSON``: the same for the supervised
  stages, several in one launch (the ranks start once): ``RUNS_JSON`` maps a name to
  ``[STOP_STEP, <main.py arguments>]`` (``dpo ...``, ``sft ...``); a run stops after ``STOP_STEP``
  steps and resumes (``null``: runs straight through), and each rank saves its final trainable
  weights to ``DUMP_DIR/<name>/rank<r>.safetensors``.
* ``python -m tests.distributed_helpers agents RUN_YAML DUMP_DIR``: GRPO with tools and seeded
  environments (``tests.test_agent_trainer``'s ``Dice``) on its two prompts for one step; each
  rank saves its final trainable weights to ``DUMP_DIR/rank<r>.safetensors``.
* ``python -m tests.distributed_helpers checks RUN_YAML``: checks the all-reduced statistics and
  the agreement checks of :mod:`base_setup.distributed` against single-process references, and
  that PPOTrainer refuses ranks whose configs differ (rank 1 changes the learning rate of
  ``RUN_YAML``), printing ``rank <r>: <check> ok`` lines.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, Sequence

from base_setup import setup_blas


def e_rate(prompts: list[str], completions: list[str]) -> list[float]:
    """A reward the tiny model can move: the share of the letter 'e' in the completion."""
    return [c.count("e") / max(len(c), 1) for c in completions]


def letter_rate(prompts: list[str], completions: list[str], letter: list[str]) -> list[float]:
    """The share of the prompt record's ``letter`` in the completion."""
    return [c.count(x) / max(len(c), 1) for c, x in zip(completions, letter)]


def _train_then_resume(dump_dir: Path, stop_step: int, argv: list[str]) -> int:
    import mlx.core as mx
    from mlx.utils import tree_flatten

    import main
    from ppo_trainer.callbacks import TrainerCallback
    from ppo_trainer.ppo_trainer import PPOTrainer

    class DumpWeights(TrainerCallback):
        def on_train_end(self, trainer: Any, history: Any) -> None:
            weights = dict(tree_flatten(trainer.policy.trainable_parameters()))
            if trainer.value_model is not None:
                value = dict(tree_flatten(trainer.value_model.trainable_parameters()))
                weights.update({f"value.{k}": v for k, v in value.items()})
            dump_dir.mkdir(parents=True, exist_ok=True)
            mx.save_safetensors(str(dump_dir / f"rank{trainer.rank}.safetensors"), weights)

    original_train = PPOTrainer.train

    def train_with_dump(self: PPOTrainer, prompts: Any, *args: Any, **kwargs: Any) -> Any:
        kwargs["callbacks"] = [*(kwargs.get("callbacks") or []), DumpWeights()]
        return original_train(self, prompts, *args, **kwargs)

    setattr(PPOTrainer, "train", train_with_dump)
    code = main.main([*argv, "--set", f"total_steps={stop_step}"])
    if code != 0:
        return code
    return main.main([*argv, "--resume", "latest"])


def _stages(dump_dir: Path, runs: dict[str, tuple[int | None, list[str]]]) -> int:
    import mlx.core as mx
    from mlx.utils import tree_flatten

    import main
    from finetune.supervised_trainer import SupervisedTrainer
    from training.callbacks import TrainerCallback

    current = {"name": ""}

    class DumpWeights(TrainerCallback):
        def on_train_end(self, trainer: Any, history: Any) -> None:
            weights = dict(tree_flatten(trainer.model.trainable_parameters()))
            folder = dump_dir / current["name"]
            folder.mkdir(parents=True, exist_ok=True)
            mx.save_safetensors(str(folder / f"rank{trainer.rank}.safetensors"), weights)

    original_train = SupervisedTrainer.train

    def train_with_dump(
        self: SupervisedTrainer[Any, Any],
        train_data: Any,
        eval_data: Any = None,
        resume_from: Any = None,
        callbacks: Any = (),
    ) -> Any:
        return original_train(self, train_data, eval_data, resume_from, [*callbacks, DumpWeights()])

    setattr(SupervisedTrainer, "train", train_with_dump)
    for name, (stop_step, argv) in runs.items():
        current["name"] = name
        calls = [argv]
        if stop_step is not None:
            calls = [[*argv, "--set", f"total_steps={stop_step}"], [*argv, "--resume", "latest"]]
        for args in calls:
            code = main.main(args)
            if code != 0:
                return code
    return 0


def _check_collectives() -> None:
    """Global statistics over ranks equal the single-process ones on the concatenated batch."""
    import mlx.core as mx
    import numpy as np

    from advantage.group_advantage import group_advantages
    from advantage.reinforce_pp import reinforce_pp_advantages
    from advantage.whitening import masked_mean, masked_var, masked_whiten
    from base_setup import distributed as dist

    group = dist.world()
    n, r = group.size(), group.rank()
    rng = np.random.default_rng(0)  # the same global batch on every rank
    x = mx.array(rng.normal(3.0, 2.0, size=(2 * n, 5)).astype(np.float32))  # (B, T)
    # Ragged masks: rank r's rows have different numbers of valid tokens.
    mask = mx.array((np.arange(5)[None, :] < np.arange(2 * n)[:, None] % 5 + 1).astype(np.float32))
    rows = slice(2 * r, 2 * r + 2)
    local_x, local_mask = x[rows], mask[rows]

    def close(a: mx.array, b: mx.array) -> bool:
        return bool(np.allclose(np.array(a), np.array(b), rtol=1e-5, atol=1e-6))

    assert close(masked_mean(local_x, local_mask, group=group), masked_mean(x, mask))
    assert close(masked_var(local_x, local_mask, group=group), masked_var(x, mask))
    assert close(masked_whiten(local_x, local_mask, group=group), masked_whiten(x, mask)[rows])
    assert close(
        masked_whiten(local_x, local_mask, shift_mean=False, group=group),
        masked_whiten(x, mask, shift_mean=False)[rows],
    )
    # Without a group the statistics stay local.
    assert close(masked_mean(local_x, local_mask), masked_mean(local_x, local_mask, group=None))
    assert not close(masked_mean(local_x, local_mask), masked_mean(x, mask))
    # GRPO: each rank holds whole prompt groups (2 prompts x 3 samples); "batch" uses the global std.
    scores = mx.array(rng.normal(size=(6 * n,)).astype(np.float32))  # (B,)
    local_scores = scores[6 * r : 6 * r + 6]
    for scale in ("group", "batch", "none"):
        want = group_advantages(scores, 3, scale)[6 * r : 6 * r + 6]
        assert close(group_advantages(local_scores, 3, scale, group=group), want), scale
    # Without the group, "batch" would use the local std.
    want = group_advantages(scores, 3, "batch")[6 * r : 6 * r + 6]
    assert not close(group_advantages(local_scores, 3, "batch"), want)
    # REINFORCE++: returns whitened with the statistics of the global batch.
    seq_scores = mx.array(rng.normal(size=(2 * n,)).astype(np.float32))  # (B,)
    want = reinforce_pp_advantages(seq_scores, x, mask, 0.05, 0.9)[0][rows]
    got = reinforce_pp_advantages(seq_scores[rows], local_x, local_mask, 0.05, 0.9, group=group)
    assert close(got[0], want)
    print(f"rank {r}: global whitening ok", flush=True)

    assert dist.all_mean(mx.array([float(r)])).item() == (n - 1) / 2
    assert dist.any_rank(r == n - 1) and not dist.any_rank(False)
    grads = {"w": mx.full((3,), float(r + 1))}
    assert close(dist.average_gradients(grads)["w"], mx.full((3,), (n + 1) / 2))
    print(f"rank {r}: reductions ok", flush=True)

    dist.check_same_on_all_ranks(b"same everywhere", "the payload", "fix it")
    dist.check_same_weights({"w": mx.arange(4, dtype=mx.float32)}, "w")
    _expect_error(
        lambda: dist.check_same_on_all_ranks(
            b"rank 0" if r == 0 else b"another", "the payload", "fix it"
        ),
        f"the payload differs between ranks: rank(s) {', '.join(map(str, range(1, n)))}",
    )
    _expect_error(
        # One ulp apart on the ranks after 0: fingerprints compare bits, not values.
        lambda: dist.check_same_weights(
            {"w": mx.array([1.0, 2.0 if r == 0 else float(np.nextafter(np.float32(2), 3))])}, "w"
        ),
        "w differs between ranks",
    )
    error = ValueError("only rank 0 failed") if r == 0 else None
    _expect_error(
        lambda: dist.raise_if_any_rank_failed(error, "the step"),
        "only rank 0 failed" if r == 0 else "the step failed on rank(s) 0",
    )
    print(f"rank {r}: agreement checks ok", flush=True)


def _expect_error(fn: Any, message: str) -> None:
    try:
        fn()
    except ValueError as err:
        if message not in str(err):
            raise AssertionError(f"expected {message!r} in the error, got {err}") from err
        return
    raise AssertionError(f"expected a ValueError with {message!r}")


def _check_config_agreement(run_yaml: str) -> None:
    """Ranks built from configs that differ (rank 1: another learning rate) fail together."""
    from base_setup import distributed as dist
    from config.loading import load_config
    from ppo_trainer.ppo_trainer import PPOTrainer

    r, n = dist.rank(), dist.world_size()
    config = load_config(run_yaml, [f"learning_rate={1e-3 if r == 0 else 2e-3}"])
    expected = (
        f"the configuration differs between ranks: rank(s) {', '.join(map(str, range(1, n)))}"
    )
    _expect_error(lambda: PPOTrainer(config, reward_model=e_rate), expected)
    print(f"rank {r}: config agreement ok", flush=True)


def _agents(run_yaml: Path, dump_dir: Path) -> int:
    import mlx.core as mx
    from mlx.utils import tree_flatten

    from config.loading import load_config
    from ppo_trainer.ppo_trainer import PPOTrainer
    from tests.test_agent_trainer import PROMPTS, Dice

    trainer = PPOTrainer(load_config(run_yaml), environment_factory=Dice)
    trainer.train(PROMPTS, num_epochs=1)
    weights = dict(tree_flatten(trainer.policy.trainable_parameters()))
    dump_dir.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(dump_dir / f"rank{trainer.rank}.safetensors"), weights)
    return 0


def run(argv: Sequence[str]) -> int:
    """The command line of this module (see the module docstring)."""
    if len(argv) == 2 and argv[0] == "checks":
        _check_collectives()
        _check_config_agreement(argv[1])
        return 0
    if len(argv) >= 4 and argv[0] == "train" and argv[3] == "--":
        return _train_then_resume(Path(argv[1]), int(argv[2]), list(argv[4:]))
    if len(argv) == 3 and argv[0] == "agents":
        return _agents(Path(argv[1]), Path(argv[2]))
    if len(argv) == 3 and argv[0] == "stages":
        return _stages(Path(argv[1]), json.loads(Path(argv[2]).read_text()))
    raise SystemExit(
        "usage: python -m tests.distributed_helpers {checks RUN_YAML | train DUMP_DIR STOP_STEP -- "
        "<main.py train arguments> | stages DUMP_DIR RUNS_JSON | agents RUN_YAML DUMP_DIR}"
    )


if __name__ == "__main__":
    setup_blas()  # first: MLX's fast BLAS, before run() imports mlx
    sys.exit(run(sys.argv[1:]))
