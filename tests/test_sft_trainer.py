"""Tests for finetune/sft_trainer.py, the shared loop (finetune/supervised_trainer.py) and
config/sft_config.py: the loss against a naive reference, full and LoRA fine-tuning on the tiny
model, gradient accumulation, resuming, and the saved model loading as PPO's policy."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any, cast

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

from base_setup.lora_setup import LoraSettings
from config.loading import load_config, save_config
from config.sft_config import SFTConfig
from fixtures.demo_data import sft_records, write_sft_data
from models.policy_model import PolicyModel
from training.metrics_logger import METRICS_FILE, PLOT_FILE, read_metrics
from finetune.sft_trainer import SFTTrainer, run_sft, sft_loss
from token_attribution.sequences import next_token_scores
from finetune.records import load_sft_data
from training.optimizer import lr_schedule
from finetune.supervised_trainer import load_run_data
from training.run_control import CONFIG_FILE

PROMPTS = ["Review of the camera:", "Review of the sushi bar:"]


def flat(tree: Any) -> dict[str, np.ndarray]:
    return {k: np.array(v) for k, v in cast(list[tuple[str, Any]], tree_flatten(tree))}


def config(model_dir: Path, out: Path, **overrides: Any) -> SFTConfig:
    values: dict[str, Any] = dict(
        model_name=str(model_dir),
        output_dir=str(out),
        learning_rate=3e-3,
        batch_size=8,
        num_epochs=1,
        lr_scheduler="constant",
        progress_bar=False,
        keep_last_checkpoints=0,
    )
    values.update(overrides)
    return SFTConfig(**values)


def prompt_logits(model: PolicyModel) -> np.ndarray:
    ids = [model.tokenizer.encode(p, add_special_tokens=False) for p in PROMPTS]
    width = max(len(i) for i in ids)
    batch = mx.array([i + [model.tokenizer.pad_token_id] * (width - len(i)) for i in ids])
    return np.array(model(batch))


# --------------------------------------------------------------------------- the loss


def test_sft_loss_matches_a_naive_reference() -> None:
    """The loss and token accuracy of next_token_scores' log-probs (here through a callable's
    logits) against a float64 cross-entropy, and its gradient against central differences;
    masked positions get no gradient."""
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(2, 5, 7)).astype(np.float32)  # at positions 0..4 of 6 tokens
    ids = rng.integers(0, 7, size=(2, 6))
    ids[0, 3], ids[1, 2] = logits[0, 2].argmax(), logits[1, 1].argmax()  # two argmax targets
    targets = ids[:, 1:]
    mask = np.array([[0, 0, 1, 1, 1], [0, 1, 1, 0, 0]], dtype=np.float32)

    def naive(lg: np.ndarray) -> float:
        total, count = 0.0, 0
        for b in range(2):
            for t in range(5):
                if mask[b, t]:
                    row = lg[b, t].astype(np.float64)
                    total += np.log(np.exp(row - row.max()).sum()) + row.max() - row[targets[b, t]]
                    count += 1
        return total / count

    def loss_of(x: mx.array) -> tuple[mx.array, dict[str, mx.array]]:
        scores = next_token_scores(lambda context: x, mx.array(ids))
        return sft_loss(scores.logprobs, scores.top, mx.array(mask))

    loss, metrics = loss_of(mx.array(logits))
    np.testing.assert_allclose(loss.item(), naive(logits), rtol=1e-5)
    hits = (logits.argmax(-1) == targets) * mask
    assert 0 < hits.sum() < mask.sum()  # some targets are the argmax, some not
    np.testing.assert_allclose(metrics["sft/token_accuracy"].item(), hits.sum() / mask.sum())
    # Gradient against central differences of the naive loss; masked positions get none.
    grad = np.array(mx.grad(lambda x: loss_of(x)[0])(mx.array(logits)))
    eps = 1e-3
    for b, t, v in [(0, 2, 3), (1, 1, 0), (0, 4, 6)]:
        up, down = logits.copy(), logits.copy()
        up[b, t, v] += eps
        down[b, t, v] -= eps
        np.testing.assert_allclose(grad[b, t, v], (naive(up) - naive(down)) / (2 * eps), atol=1e-3)
    assert np.all(grad[mask == 0] == 0)


def test_lr_schedule_warmup_then_decay() -> None:
    sched = lr_schedule(1.0, "linear", warmup_steps=2, total_steps=6)
    values = [float(sched(mx.array(s))) for s in range(6)]
    np.testing.assert_allclose(values, [0.0, 0.5, 1.0, 0.75, 0.5, 0.25], atol=1e-6)
    cosine = lr_schedule(1.0, "cosine", warmup_steps=0, total_steps=4)
    np.testing.assert_allclose(
        [float(cosine(mx.array(s))) for s in range(4)],
        [0.5 * (1 + np.cos(np.pi * s / 4)) for s in range(4)],
        atol=1e-6,
    )


# --------------------------------------------------------------------------- training


@pytest.mark.plots
@pytest.mark.slow
def test_full_sft_learns_and_loads_as_the_ppo_policy(tiny_model_dir: Path, tmp_path: Path) -> None:
    data = write_sft_data(tmp_path / "sft.jsonl", 20, seed=1)
    cfg = config(
        tiny_model_dir,
        tmp_path / "run",
        dataset=str(data),
        eval_fraction=0.2,
        num_epochs=4,
        batch_size=8,
        eval_every=4,
        save_every=3,
    )
    base = PolicyModel.from_pretrained(tiny_model_dir)
    out = run_sft(cfg)
    assert out == tmp_path / "run" / "model"

    records = read_metrics(tmp_path / "run" / METRICS_FILE)
    steps = [r["step"] for r in records]
    assert steps == list(range(9))  # step 0: the evaluation before training; 2 batches x 4 epochs
    assert records[-1]["epoch"] == 3
    assert records[-1]["eval/loss"] < records[0]["eval/loss"] - 0.5  # held-out loss falls
    assert records[-1]["loss/sft"] < records[1]["loss/sft"]
    assert (tmp_path / "run" / PLOT_FILE).stat().st_size > 0
    assert load_config(tmp_path / "run" / CONFIG_FILE, cls=SFTConfig) == cfg
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir()) == [
        "step_000003",
        "step_000006",
        "step_000008",
    ]

    # The output loads as PPO's policy/reference; every weight moved.
    trained = PolicyModel.from_pretrained(out)
    assert trained.tokenizer.pad_token_id == base.tokenizer.pad_token_id
    assert not np.allclose(prompt_logits(trained), prompt_logits(base), atol=1e-3)
    before, after = flat(base.trainable_parameters()), flat(trained.trainable_parameters())
    assert before.keys() == after.keys()
    unchanged = [k for k in before if np.array_equal(before[k], after[k])]
    assert unchanged == []


@pytest.mark.slow
def test_lora_sft_trains_only_adapters_and_saves_merged(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    cfg = config(tiny_model_dir, tmp_path / "run", use_lora=True, lora_r=4, lora_alpha=8.0)
    trainer = SFTTrainer(cfg)
    assert trainer.policy.lora == LoraSettings(r=4, alpha=8.0, dropout=0.0)
    before = flat(trainer.model.parameters())
    trainable = set(flat(trainer.model.trainable_parameters()))
    assert trainable and all(k.endswith(("lora_a", "lora_b")) for k in trainable)
    trainer.train(sft_records(16, seed=0))
    after = flat(trainer.model.parameters())
    changed = {k for k in before if not np.array_equal(before[k], after[k])}
    assert changed == trainable  # every adapter moved (lora_b leaves zero), no base weight did

    out = trainer.save_pretrained(tmp_path / "merged")
    assert not (out / "adapters.safetensors").exists()
    merged = PolicyModel.from_pretrained(out)
    assert merged.lora is None
    assert not any(k.endswith(("lora_a", "lora_b")) for k in flat(merged.parameters()))
    np.testing.assert_allclose(
        prompt_logits(merged), prompt_logits(trainer.policy), rtol=1e-4, atol=1e-4
    )
    base = PolicyModel.from_pretrained(tiny_model_dir)
    assert not np.allclose(prompt_logits(merged), prompt_logits(base), atol=1e-3)


@pytest.mark.slow
def test_gradient_accumulation_gives_the_same_update(tiny_model_dir: Path, tmp_path: Path) -> None:
    # Examples of different lengths, so micro-batches hold different numbers of target tokens.
    records = sft_records(8, seed=4)
    base = flat(PolicyModel.from_pretrained(tiny_model_dir).trainable_parameters())
    updates, losses = [], []
    for accumulation in (1, 4):
        # adam_eps=1 makes AdamW's first update (about 0.1 * lr * g) linear in the gradient, so
        # comparing the updates compares the gradients (a tiny eps would compare their signs).
        cfg = config(
            tiny_model_dir,
            tmp_path / f"acc{accumulation}",
            gradient_accumulation_steps=accumulation,
            learning_rate=1.0,
            adam_eps=1.0,
            max_grad_norm=float("inf"),
            total_steps=1,
        )
        trainer = SFTTrainer(cfg)
        losses.append(trainer.train(records)[-1]["loss/sft"])
        after = flat(trainer.model.trainable_parameters())
        updates.append({k: after[k] - base[k] for k in base})
    np.testing.assert_allclose(losses[0], losses[1], rtol=1e-5)
    scale = max(np.abs(u).max() for u in updates[0].values())
    assert scale > 1e-4
    for key, update in updates[0].items():
        np.testing.assert_allclose(
            updates[1][key], update, rtol=1e-3, atol=1e-4 * scale, err_msg=key
        )


@pytest.mark.slow
def test_gradient_checkpointing_gives_the_same_update(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Both runs on the same BLAS thread count: on a loaded machine the adaptive count can differ
    # between them, and with it the matmuls' summation order.
    monkeypatch.setenv("PPO_MLX_ADAPTIVE_BLAS", "off")
    records = sft_records(8, seed=5)
    base = flat(PolicyModel.from_pretrained(tiny_model_dir).trainable_parameters())
    afters = []
    for checkpointing in (False, True):
        cfg = config(
            tiny_model_dir,
            tmp_path / f"ckpt{checkpointing}",
            gradient_checkpointing=checkpointing,
            total_steps=2,
        )
        trainer = SFTTrainer(cfg)
        trainer.train(records)
        afters.append(flat(trainer.model.trainable_parameters()))
    changed = [k for k in base if not np.array_equal(base[k], afters[1][k])]
    assert changed == list(base)  # every trainable parameter moved
    for key, want in afters[0].items():
        np.testing.assert_allclose(afters[1][key], want, rtol=1e-5, atol=1e-6, err_msg=key)


@pytest.mark.slow
def test_resume_continues_to_the_same_weights(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PPO_MLX_ADAPTIVE_BLAS", "off")  # two fresh runs: the same BLAS threads
    records = sft_records(24, seed=2)
    common: dict[str, Any] = dict(
        num_epochs=2, batch_size=8, save_every=2, lr_scheduler="cosine", warmup_steps=1
    )
    full = SFTTrainer(config(tiny_model_dir, tmp_path / "full", **common))
    full_history = full.train(records)
    assert full.global_step == 6

    # A second run that has only the step-2 checkpoint of the first resumes from "latest".
    resumed_dir = tmp_path / "resumed"
    (resumed_dir / "checkpoints").mkdir(parents=True)
    shutil.copytree(
        tmp_path / "full" / "checkpoints" / "step_000002",
        resumed_dir / "checkpoints" / "step_000002",
    )
    (resumed_dir / METRICS_FILE).write_text(
        "".join(json.dumps(r) + "\n" for r in full_history[:3])  # and a line past the checkpoint
    )
    resumed = SFTTrainer(config(tiny_model_dir, resumed_dir, **common))
    history = resumed.train(records, resume_from="latest")
    assert resumed.global_step == 6 and resumed.epoch == 2
    assert [r["step"] for r in history] == [1, 2, 3, 4, 5, 6]
    assert [r["step"] for r in read_metrics(resumed_dir / METRICS_FILE)] == [1, 2, 3, 4, 5, 6]
    np.testing.assert_allclose(
        [r["loss/sft"] for r in history[2:]], [r["loss/sft"] for r in full_history[2:]], rtol=1e-5
    )
    np.testing.assert_allclose(
        [r["lr"] for r in history[2:]], [r["lr"] for r in full_history[2:]], rtol=1e-6
    )
    w_full, w_resumed = flat(full.model.parameters()), flat(resumed.model.parameters())
    for key in w_full:
        np.testing.assert_allclose(w_resumed[key], w_full[key], rtol=1e-5, atol=1e-6, err_msg=key)

    # A checkpoint of another configuration is refused.
    other = SFTTrainer(config(tiny_model_dir, resumed_dir, **{**common, "batch_size": 4}))
    with pytest.raises(ValueError, match="batch_size=8 but this run has batch_size=4"):
        other.train(records, resume_from=resumed_dir / "checkpoints" / "step_000002")
    with pytest.raises(FileNotFoundError, match="no complete checkpoint under"):
        SFTTrainer(config(tiny_model_dir, tmp_path / "empty", **common)).train(
            records, resume_from="latest"
        )


def test_an_extension_that_cannot_train_is_refused_naming_the_setting(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """issue #47: a resume with a larger total_steps trained nothing and exited 0 in silence
    when num_epochs already ended the run; and the converse with total_steps."""
    records = sft_records(8, seed=2)
    SFTTrainer(config(tiny_model_dir, tmp_path / "run", total_steps=1)).train(records)
    # The run ended at step 1 by total_steps: more epochs alone cannot extend it.
    more_epochs = config(tiny_model_dir, tmp_path / "run", total_steps=1, num_epochs=3)
    with pytest.raises(ValueError, match=r"total_steps=1 ends the run at step 1.*total_steps=3"):
        SFTTrainer(more_epochs).train(records, resume_from="latest")
    # total_steps=3 without more epochs: num_epochs=1 ends it.
    more_steps = config(tiny_model_dir, tmp_path / "run", total_steps=3)
    with pytest.raises(ValueError, match=r"num_epochs=1 \(1 x 1 steps per epoch\) ends the run"):
        SFTTrainer(more_steps).train(records, resume_from="latest")
    both = config(tiny_model_dir, tmp_path / "run", total_steps=3, num_epochs=3)
    assert SFTTrainer(both).train(records, resume_from="latest")[-1]["step"] == 3


# --------------------------------------------------------------------------- config and errors


def test_sft_config_validation_and_yaml(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="gradient_accumulation_steps to one of \\[1, 2, 3, 6\\]"):
        SFTConfig(model_name="m", batch_size=6, gradient_accumulation_steps=4)
    with pytest.raises(ValueError, match="eval_fraction must be in \\[0, 1\\), got 1.0"):
        SFTConfig(model_name="m", eval_fraction=1.0)
    with pytest.raises(ValueError, match="lora_dropout must be in \\[0, 1\\)"):
        SFTConfig(model_name="m", use_lora=True, lora_dropout=1.5)
    with pytest.raises(ValueError, match="lr_scheduler must be one of"):
        SFTConfig(model_name="m", lr_scheduler="step")  # type: ignore[arg-type]
    path = tmp_path / "sft.yaml"
    path.write_text("model_name: runs/base\ndataset: sft.jsonl\nlearning_rate: 1e-4\n")
    cfg = load_config(path, ["use_lora=true", "batch-size=16"], cls=SFTConfig)
    assert (cfg.dataset, cfg.learning_rate, cfg.use_lora, cfg.batch_size) == (
        "sft.jsonl",
        1e-4,
        True,
        16,
    )
    assert cfg.output_dir == "runs/sft" and cfg.micro_batch_size == 16
    cfg.max_grad_norm = float("inf")
    assert load_config(save_config(cfg, tmp_path / "saved.yaml"), cls=SFTConfig) == cfg


def test_load_run_data_reads_an_eval_dataset_or_holds_out(tmp_path: Path) -> None:
    train_file = write_sft_data(tmp_path / "train.jsonl", 20, seed=0)
    eval_file = write_sft_data(tmp_path / "eval.jsonl", 3, seed=1)
    cfg = SFTConfig(model_name="m", dataset=str(train_file), eval_dataset=str(eval_file))
    train, held_out = load_run_data(cfg, load_sft_data)
    assert (train, held_out) == (sft_records(20, seed=0), sft_records(3, seed=1))
    cfg = SFTConfig(model_name="m", dataset=str(train_file), eval_fraction=0.25)
    train, held_out = load_run_data(cfg, load_sft_data)
    assert held_out is not None and (len(train), len(held_out)) == (15, 5)
    cfg = SFTConfig(model_name="m", dataset=str(train_file), eval_fraction=0.0)
    assert load_run_data(cfg, load_sft_data) == (sft_records(20, seed=0), None)


def test_model_and_config_must_agree_on_lora(tiny_model_dir: Path, tmp_path: Path) -> None:
    model = PolicyModel.from_pretrained(tiny_model_dir)
    with pytest.raises(ValueError, match="has no LoRA adapters but config.use_lora=True"):
        SFTTrainer(config(tiny_model_dir, tmp_path, use_lora=True), model=model)
    with pytest.raises(ValueError, match="dataset is not set"):
        run_sft(config(tiny_model_dir, tmp_path))


def test_a_supervised_stage_takes_the_one_callback_type_and_ends_its_epochs(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """The loop of every stage (training/loop.py): a plain fn(epoch, metrics) and a
    TrainerCallback's on_epoch_end see each pass over the data with its mean metrics, as in PPO;
    StageCallback is the same class."""
    from finetune.supervised_trainer import StageCallback
    from training.callbacks import TrainerCallback

    assert StageCallback is TrainerCallback
    epochs: list[tuple[int, dict[str, float]]] = []
    steps: list[tuple[int, int]] = []

    class Steps(TrainerCallback):
        def on_step_end(self, trainer: Any, step: int, metrics: dict[str, float]) -> None:
            steps.append((step, trainer.epoch))

    trainer = SFTTrainer(config(tiny_model_dir, tmp_path / "run", num_epochs=2))
    history = trainer.train(
        sft_records(12, seed=2), callbacks=[Steps(), lambda e, m: epochs.append((e, m))]
    )
    assert [e for e, _ in epochs] == [0, 1] and trainer.epoch == 2
    assert [m["steps"] for _, m in epochs] == [2.0, 2.0]
    # The epoch moves on after its last step's hooks: each step belongs to its own pass.
    assert steps == [(1, 0), (2, 0), (3, 1), (4, 1)]
    mean = float(np.mean([r["loss/sft"] for r in history if r["epoch"] == 1]))
    assert epochs[1][1]["loss/sft"] == pytest.approx(mean)
