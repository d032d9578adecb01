"""Tests for DPO and its family: the losses (training/preference_loss.py) against naive references
and TRL's numbers, the tokenisation of pairs, DPOTrainer (finetune/dpo_trainer.py: every
parameter moves, the reference cached and not recomputed on resume, resume equals an uninterrupted
run, bad input), config/dpo_config.py, ``main.py dpo`` and the demo's DPO branch."""

from __future__ import annotations

import io
import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any, cast

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten

from base_setup import backend
from config.dpo_config import DPOConfig
from config.loading import load_config
from finetune.dpo_trainer import (
    REFERENCE_CACHE,
    DPOTrainer,
    answer_token_logps,
    dpo_batch_loss,
    run_dpo,
)
from finetune.supervised_trainer import StageCallback
from finetune.tokenize import DPOBatch, collate_dpo, tokenize_dpo_pairs
from fixtures.demo_data import preference_records, write_jsonl
from models.policy_model import PolicyModel
from models.sft_model import ReferenceModel
from training.metrics_logger import METRICS_FILE, PLOT_FILE, read_metrics
from training.preference_loss import (
    answer_logps,
    hinge_loss,
    ipo_loss,
    log1mexp,
    orpo_log_odds_ratio,
    preference_loss,
    robust_loss,
    sigmoid_loss,
    simpo_loss,
)
from tests import trl_dpo_reference as trl_ref

ROOT = Path(__file__).resolve().parents[1]
TRL_NUMBERS = Path(__file__).parent / "data" / "trl_dpo_reference.json"


def flat(tree: Any) -> dict[str, np.ndarray]:
    return {k: np.array(v) for k, v in cast(list[tuple[str, Any]], tree_flatten(tree))}


def log_sigmoid(x: float) -> float:
    return -math.log1p(math.exp(-x)) if x > 0 else x - math.log1p(math.exp(x))


# --------------------------------------------------------------------------- the losses


RNG = np.random.default_rng(0)
PC, PR, RC, RR = (RNG.normal(-8.0, 3.0, size=6).astype(np.float32) for _ in range(4))
LEN_C = np.array([3, 5, 1, 8, 2, 4], dtype=np.float32)
LEN_R = np.array([4, 2, 6, 1, 3, 4], dtype=np.float32)


def naive_losses(loss_type: str, beta: float, eps: float, gamma: float) -> list[float]:
    """Each pair's loss written out from the papers' formulas, in float64."""
    out = []
    for b in range(len(PC)):
        pc, pr, rc, rr = (float(x[b]) for x in (PC, PR, RC, RR))
        h = (pc - rc) - (pr - rr)
        if loss_type == "sigmoid":  # DPO eq. 7, cDPO
            out.append(-(1 - eps) * log_sigmoid(beta * h) - eps * log_sigmoid(-beta * h))
        elif loss_type == "robust":  # Chowdhury et al. eq. 7
            out.append(
                (-(1 - eps) * log_sigmoid(beta * h) + eps * log_sigmoid(-beta * h)) / (1 - 2 * eps)
            )
        elif loss_type == "hinge":
            out.append(max(0.0, 1 - beta * h))
        elif loss_type == "ipo":  # on per-token averaged log-ratios
            h_avg = (pc - rc) / LEN_C[b] - (pr - rr) / LEN_R[b]
            out.append((h_avg - 1 / (2 * beta)) ** 2)
        elif loss_type == "simpo":
            u = beta * (pc / LEN_C[b] - pr / LEN_R[b]) - gamma
            out.append(-(1 - eps) * log_sigmoid(u) - eps * log_sigmoid(-u))
    return out


@pytest.mark.parametrize(
    "loss_type, beta, eps",
    [
        ("sigmoid", 0.1, 0.0),
        ("sigmoid", 0.3, 0.2),
        ("robust", 0.1, 0.1),
        ("hinge", 0.5, 0.0),
        ("ipo", 0.1, 0.0),
        ("simpo", 2.0, 0.1),
    ],
)
def test_losses_match_the_papers_formulas(loss_type: str, beta: float, eps: float) -> None:
    want = naive_losses(loss_type, beta, eps, gamma=0.5)
    loss, metrics = preference_loss(
        loss_type,  # type: ignore[arg-type]
        mx.array(PC),
        mx.array(PR),
        mx.array(RC),
        mx.array(RR),
        mx.array(LEN_C),
        mx.array(LEN_R),
        beta=beta,
        label_smoothing=eps,
        simpo_gamma=0.5,
    )
    np.testing.assert_allclose(loss.item(), np.mean(want), rtol=1e-5, atol=1e-6)
    if loss_type == "simpo":  # beta * average log-prob
        chosen, rejected = beta * PC / LEN_C, beta * PR / LEN_R
    else:  # beta * (log pi - log pi_ref), summed log-probs
        chosen, rejected = beta * (PC - RC), beta * (PR - RR)
    np.testing.assert_allclose(metrics["rewards/chosen"].item(), chosen.mean(), rtol=1e-5)
    np.testing.assert_allclose(metrics["rewards/rejected"].item(), rejected.mean(), rtol=1e-5)
    np.testing.assert_allclose(
        metrics["rewards/margins"].item(), (chosen - rejected).mean(), rtol=1e-5, atol=1e-6
    )
    assert metrics["rewards/accuracies"].item() == pytest.approx(np.mean(chosen > rejected))
    assert 0 < np.array(metrics["rewards/accuracies"]) < 1  # pairs either way in the data


def test_pure_losses_and_their_gradients() -> None:
    h = mx.array([-3.0, -0.2, 0.0, 0.7, 12.0])
    beta, eps = 0.25, 0.1
    for fn, naive in (
        (
            lambda x: sigmoid_loss(x, beta, eps),
            lambda x: -(1 - eps) * log_sigmoid(beta * x) - eps * log_sigmoid(-beta * x),
        ),
        (
            lambda x: robust_loss(x, beta, eps),
            lambda x: (-(1 - eps) * log_sigmoid(beta * x) + eps * log_sigmoid(-beta * x))
            / (1 - 2 * eps),
        ),
        (lambda x: hinge_loss(x, beta), lambda x: max(0.0, 1 - beta * x)),
        (lambda x: ipo_loss(x, beta), lambda x: (x - 1 / (2 * beta)) ** 2),
    ):
        values = fn(h)
        np.testing.assert_allclose(
            np.array(values), [naive(float(x)) for x in np.array(h)], rtol=1e-5, atol=1e-6
        )
        # The gradient against central differences of the naive formula (away from hinge kinks).
        grad = np.array(mx.grad(lambda x: fn(x).sum())(h))
        step = 1e-4
        numeric = [
            (naive(float(x) + step) - naive(float(x) - step)) / (2 * step) for x in np.array(h)
        ]
        np.testing.assert_allclose(grad, numeric, rtol=1e-3, atol=1e-4)
    # SimPO: u = beta * (c - r) - gamma.
    c, r = mx.array([-0.5, -2.0]), mx.array([-1.5, -0.1])
    got = np.array(simpo_loss(c, r, 2.0, 0.5))
    want = [-log_sigmoid(2.0 * (-0.5 + 1.5) - 0.5), -log_sigmoid(2.0 * (-2.0 + 0.1) - 0.5)]
    np.testing.assert_allclose(got, want, rtol=1e-6)


def test_orpo_odds_ratio_and_log1mexp() -> None:
    a = np.array([-1e-6, -0.1, -0.69, -0.7, -5.0, -40.0])
    np.testing.assert_allclose(
        np.array(log1mexp(mx.array(a, dtype=mx.float32))),
        np.log(-np.expm1(a)),
        rtol=1e-4,
        atol=1e-12,
    )
    c, r = -0.3, -1.2
    log_odds = (c - math.log(1 - math.exp(c))) - (r - math.log(1 - math.exp(r)))
    got = orpo_log_odds_ratio(mx.array([c]), mx.array([r])).item()
    assert got == pytest.approx(log_sigmoid(log_odds), rel=1e-5)
    # The full loss: NLL - beta * mean(log sigmoid(log odds ratio)), rewards beta * avg logp.
    loss, metrics = preference_loss(
        "orpo",
        mx.array([c * 4]),
        mx.array([r * 2]),
        None,
        None,
        mx.array([4.0]),
        mx.array([2.0]),
        beta=0.1,
        chosen_nll=mx.array(0.3),
    )
    assert loss.item() == pytest.approx(0.3 - 0.1 * log_sigmoid(log_odds), rel=1e-5)
    assert metrics["rewards/chosen"].item() == pytest.approx(0.1 * c)
    assert metrics["nll_loss"].item() == pytest.approx(0.3)
    with pytest.raises(ValueError, match="needs chosen_nll"):
        preference_loss("orpo", mx.array([c]), mx.array([r]), None, None, mx.ones(1), mx.ones(1), beta=0.1)  # fmt: skip
    with pytest.raises(ValueError, match="needs the reference"):
        preference_loss("sigmoid", mx.array([c]), mx.array([r]), None, None, mx.ones(1), mx.ones(1), beta=0.1)  # fmt: skip


def test_answer_logps_sums_the_answer_tokens() -> None:
    logps = RNG.normal(size=(3, 5)).astype(np.float32)
    mask = np.array([[0, 0, 1, 1, 0], [0, 1, 1, 1, 1], [1, 0, 0, 0, 0]], dtype=np.float32)
    want = [sum(logps[b, t] for t in range(5) if mask[b, t]) for b in range(3)]
    np.testing.assert_allclose(
        np.array(answer_logps(mx.array(logps), mx.array(mask))), want, rtol=1e-6
    )


# --------------------------------------------------------------------------- parity with TRL


class TinyLM(nn.Module):
    """The parity script's tiny LM in MLX: embedding, tanh, causal running mean, linear head."""

    def __init__(self, weights: dict[str, np.ndarray]) -> None:
        super().__init__()
        self.embed = mx.array(weights["embed"])
        self.head = mx.array(weights["head"])
        self.bias = mx.array(weights["bias"])

    def __call__(self, input_ids: mx.array) -> mx.array:
        h = mx.tanh(self.embed[input_ids])  # (N, L, D)
        steps = mx.arange(1, input_ids.shape[1] + 1, dtype=h.dtype)[None, :, None]
        h = mx.cumsum(h, axis=1) / steps
        return h @ self.head.T + self.bias  # (N, L, V)


@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo", "hinge", "robust"])
def test_loss_rewards_and_gradients_equal_trls_dpo_trainer(loss_type: str) -> None:
    """TRL 1.12's DPOTrainer._compute_loss on the same weights and pairs (numbers recorded by
    tests/trl_dpo_reference.py in a throwaway venv with torch and trl; CI has neither)."""
    case = json.loads(TRL_NUMBERS.read_text())["dpo"][loss_type]
    ids, mask = trl_ref.batch_arrays()
    policy, ref = TinyLM(trl_ref.tiny_weights(1)), TinyLM(trl_ref.tiny_weights(2))
    batch = DPOBatch(mx.array(ids), mx.array(mask.astype(np.float32)), None)
    # The reference's log-probs as DPOTrainer caches them, then the policy's loss.
    batch.ref_logps = answer_logps(*answer_token_logps(ref, batch))
    config = DPOConfig(
        model_name="unused",
        loss_type=loss_type,  # type: ignore[arg-type]
        beta=case["beta"],
        label_smoothing=case["label_smoothing"],
    )
    (loss, metrics), grads = nn.value_and_grad(
        policy, lambda model, b: dpo_batch_loss(model, b, config)
    )(policy, batch)
    assert loss.item() == pytest.approx(case["loss"], rel=1e-5, abs=1e-6)
    for key in (
        "rewards/chosen",
        "rewards/rejected",
        "rewards/accuracies",
        "rewards/margins",
        "logps/chosen",
        "logps/rejected",
    ):
        assert metrics[key].item() == pytest.approx(case["metrics"][key], rel=1e-5, abs=1e-6), key
    for name, want in case["grads"].items():
        np.testing.assert_allclose(np.array(grads[name]), want, rtol=1e-4, atol=1e-6, err_msg=name)
    assert max(np.abs(np.array(grads["head"])).max() for _ in [0]) > 1e-4  # gradients are real


def test_simpo_and_orpo_equal_trls_cpo_and_orpo_trainers() -> None:
    numbers = json.loads(TRL_NUMBERS.read_text())
    chosen, rejected = (np.array(x, dtype=np.float32) for x in trl_ref.AVG_LOGPS)
    ones = mx.ones(len(chosen))
    simpo = numbers["simpo"]
    loss, metrics = preference_loss(
        "simpo",
        mx.array(chosen),
        mx.array(rejected),
        None,
        None,
        ones,
        ones,
        beta=simpo["beta"],
        simpo_gamma=simpo["simpo_gamma"],
    )
    assert loss.item() == pytest.approx(np.mean(simpo["losses"]), rel=1e-5)
    assert metrics["rewards/chosen"].item() == pytest.approx(np.mean(simpo["chosen_rewards"]))
    orpo = numbers["orpo"]
    ratio = orpo_log_odds_ratio(mx.array(chosen), mx.array(rejected))
    np.testing.assert_allclose(orpo["beta"] * np.array(ratio), orpo["losses"], rtol=1e-5)


# --------------------------------------------------------------------------- tokenisation


def test_pairs_tokenise_with_the_answer_masked(tiny_model_dir: Path) -> None:
    tokenizer = PolicyModel.from_pretrained(tiny_model_dir).tokenizer
    record = {"prompt": "Review of the camera:", "chosen": " Superb.", "rejected": " Awful."}
    (example,) = tokenize_dpo_pairs([record], tokenizer, max_length=64)
    prompt_ids = tokenizer.encode(record["prompt"], add_special_tokens=False)
    assert example.chosen_start == example.rejected_start == len(prompt_ids)
    assert example.chosen_ids[: len(prompt_ids)] == prompt_ids
    assert example.chosen_ids[-1] == tokenizer.eos_token_id
    batch = collate_dpo([example], tokenizer.pad_token_id)
    mask = np.array(batch.answer_mask)
    assert mask[0, : len(prompt_ids)].sum() == 0
    assert mask[0].sum() == len(example.chosen_ids) - len(prompt_ids)
    assert batch.ref_logps is None


def test_bad_pairs_are_refused_with_one_clear_message(tiny_model_dir: Path) -> None:
    tokenizer = PolicyModel.from_pretrained(tiny_model_dir).tokenizer
    good = {"prompt": "Review of the camera:", "chosen": " Superb.", "rejected": " Awful."}
    cases = [
        ({**good, "rejected": " Superb."}, "are the same text"),
        (  # the same answer, once as text and once as a message: the same tokens
            {
                "prompt": [{"role": "user", "content": "Review of the camera:"}],
                "chosen": "Superb.",
                "rejected": [{"role": "assistant", "content": "Superb."}],
            },
            "give the same tokens",
        ),
        ({"prompt": good["prompt"], "chosen": " Superb."}, "missing field 'rejected'"),
        ({**good, "prompt": "Review of the camera:" * 30}, "leaves no answer token"),
    ]
    for record, message in cases:
        with pytest.raises(ValueError, match=message):
            tokenize_dpo_pairs([good, cast(dict[str, Any], record)], tokenizer, max_length=48)
    with pytest.raises(ValueError, match="preference record 1"):
        tokenize_dpo_pairs([good, {"prompt": "x"}], tokenizer, max_length=48)


# --------------------------------------------------------------------------- the trainer


def dpo_config(model_dir: Path, out: Path, **overrides: Any) -> DPOConfig:
    values: dict[str, Any] = dict(
        model_name=str(model_dir),
        output_dir=str(out),
        learning_rate=1e-3,
        batch_size=8,
        num_epochs=1,
        lr_scheduler="constant",
        progress_bar=False,
        keep_last_checkpoints=0,
        eval_fraction=0.0,
    )
    values.update(overrides)
    return DPOConfig(**values)


@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo", "orpo"])
def test_a_step_moves_every_trainable_parameter(
    tiny_model_dir: Path, tmp_path: Path, loss_type: str
) -> None:
    trainer = DPOTrainer(dpo_config(tiny_model_dir, tmp_path, loss_type=loss_type, total_steps=1))
    before = flat(trainer.model.trainable_parameters())
    history = trainer.train(preference_records(8, seed=0))
    after = flat(trainer.model.trainable_parameters())
    assert [k for k in before if np.array_equal(before[k], after[k])] == []
    assert math.isfinite(history[-1]["loss/dpo"])
    # At the first step the policy is the reference: every implicit reward is 0 (exactly: the
    # reference's log-probs take the policy's arithmetic), sigmoid's loss is log 2 (ipo's and
    # orpo's are not).
    if loss_type == "sigmoid":
        assert history[-1]["loss/dpo"] == pytest.approx(math.log(2), abs=1e-5)
        assert history[-1]["rewards/margins"] == 0.0 and history[-1]["rewards/chosen"] == 0.0


def test_lora_dpo_trains_only_adapters_against_the_adapters_off_reference(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    cfg = dpo_config(tiny_model_dir, tmp_path / "run", use_lora=True, lora_r=4, total_steps=3)
    trainer = DPOTrainer(cfg)
    before = flat(trainer.model.parameters())
    trainable = set(flat(trainer.model.trainable_parameters()))
    trainer.train(preference_records(24, seed=0))
    assert trainer.reference().shares_policy_weights  # no second copy of the weights
    after = flat(trainer.model.parameters())
    assert {k for k in before if not np.array_equal(before[k], after[k])} == trainable
    # The cached reference log-probs are the base model's (the SFT start), not the policy's now.
    base = PolicyModel.from_pretrained(tiny_model_dir)
    examples = tokenize_dpo_pairs(preference_records(24, seed=0), base.tokenizer, cfg.max_length)
    (cache,) = (tmp_path / "run" / REFERENCE_CACHE).iterdir()
    batch = collate_dpo(examples, base.tokenizer.pad_token_id)
    want = np.array(answer_logps(*answer_token_logps(base, batch)))
    cached = np.load(cache)["logps"]  # (N, 2): chosen, rejected
    np.testing.assert_allclose(np.concatenate([cached[:, 0], cached[:, 1]]), want, rtol=1e-4)


@pytest.mark.slow
def test_gradient_checkpointing_and_accumulation_give_the_same_update(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    records = preference_records(8, seed=6)
    afters, losses = [], []
    for name, settings in (
        ("plain", {}),
        ("checkpointing", {"gradient_checkpointing": True}),
        ("accumulation", {"gradient_accumulation_steps": 4}),
    ):
        # adam_eps=1: the first update is about linear in the gradient, so updates compare
        # gradients (not only their signs).
        cfg = dpo_config(
            tiny_model_dir,
            tmp_path / name,
            total_steps=1,
            learning_rate=1.0,
            adam_eps=1.0,
            max_grad_norm=float("inf"),
            **settings,
        )
        trainer = DPOTrainer(cfg)
        losses.append(trainer.train(records)[-1]["loss/dpo"])
        afters.append(flat(trainer.model.trainable_parameters()))
    np.testing.assert_allclose(losses, losses[0], rtol=1e-5)
    for after in afters[1:]:
        for key, want in afters[0].items():
            np.testing.assert_allclose(after[key], want, rtol=1e-3, atol=1e-5, err_msg=key)


@pytest.mark.slow
def test_qlora_dpo_trains_adapters_on_a_4bit_model(tiny_model_dir: Path, tmp_path: Path) -> None:
    from fixtures.checkpoint_families import quantize_checkpoint

    q4 = quantize_checkpoint(tiny_model_dir, tmp_path / "q4")
    with pytest.raises(ValueError, match="quantized"):
        DPOTrainer(dpo_config(q4, tmp_path / "full"))
    trainer = DPOTrainer(dpo_config(q4, tmp_path / "run", use_lora=True, total_steps=2))
    before = flat(trainer.model.trainable_parameters())
    history = trainer.train(preference_records(16, seed=1))
    after = flat(trainer.model.trainable_parameters())
    assert [k for k in before if np.array_equal(before[k], after[k])] == []
    assert history[0]["loss/dpo"] == pytest.approx(math.log(2), abs=1e-5)  # reference = base


@pytest.mark.slow
def test_resume_equals_an_uninterrupted_run_without_recomputing_the_reference(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PPO_MLX_ADAPTIVE_BLAS", "off")  # two fresh runs: the same BLAS threads
    records, held_out = preference_records(24, seed=2), preference_records(6, seed=9)
    common: dict[str, Any] = dict(
        num_epochs=2, save_every=2, lr_scheduler="cosine", warmup_steps=1, eval_every=3
    )
    full = DPOTrainer(dpo_config(tiny_model_dir, tmp_path / "full", **common))
    full_history = full.train(records, held_out)
    assert full.global_step == 6
    assert len(list((tmp_path / "full" / REFERENCE_CACHE).iterdir())) == 2  # train, held-out

    # A run stopped at step 2 (its checkpoint and cache copied) resumes without the reference.
    resumed_dir = tmp_path / "resumed"
    (resumed_dir / "checkpoints").mkdir(parents=True)
    shutil.copytree(
        tmp_path / "full" / "checkpoints" / "step_000002",
        resumed_dir / "checkpoints" / "step_000002",
    )
    shutil.copytree(tmp_path / "full" / REFERENCE_CACHE, resumed_dir / REFERENCE_CACHE)

    def no_reference(self: DPOTrainer) -> ReferenceModel:
        raise AssertionError("the reference was loaded on resume")

    monkeypatch.setattr(DPOTrainer, "reference", no_reference)
    resumed = DPOTrainer(dpo_config(tiny_model_dir, resumed_dir, **common))
    history = resumed.train(records, held_out, resume_from="latest")
    assert [r["step"] for r in history] == [0, 1, 2, 3, 4, 5, 6]
    np.testing.assert_allclose(
        [r["loss/dpo"] for r in history[3:]], [r["loss/dpo"] for r in full_history[3:]], rtol=1e-5
    )
    assert history[-1]["eval/loss"] == pytest.approx(full_history[-1]["eval/loss"], rel=1e-5)
    w_full, w_resumed = flat(full.model.parameters()), flat(resumed.model.parameters())
    for key in w_full:
        np.testing.assert_allclose(w_resumed[key], w_full[key], rtol=1e-5, atol=1e-6, err_msg=key)
    # A checkpoint of another loss is refused.
    other = DPOTrainer(dpo_config(tiny_model_dir, resumed_dir, **{**common, "loss_type": "ipo"}))
    with pytest.raises(ValueError, match="loss_type"):
        other.train(records, held_out, resume_from="latest")


def test_the_reference_pass_runs_on_the_runs_blas_threads(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The run fixes OpenBLAS's thread count before the reference pass, whatever an earlier run
    in the process left (one thread, after a busy machine): the count changes a matmul's sums,
    and a reference on other threads than the policy gave the first step non-zero rewards and
    the run other numbers than in a fresh process. A resumed run recomputing the reference
    takes its checkpoint's count for it too."""
    lib = backend._OPENBLAS.get("lib")
    if lib is None or int(backend._OPENBLAS["max_threads"]) < 2:
        pytest.skip("needs OpenBLAS with 2 threads or more")
    most = int(backend._OPENBLAS["max_threads"])
    monkeypatch.setenv("PPO_MLX_ADAPTIVE_BLAS", "off")  # a fresh run takes every thread
    seen: list[int | None] = []
    original = DPOTrainer.reference_logps

    def spy(self: DPOTrainer, examples: Any) -> np.ndarray:
        seen.append(backend.blas_threads())
        return original(self, examples)

    monkeypatch.setattr(DPOTrainer, "reference_logps", spy)
    start = backend.blas_threads()
    try:
        lib.openblas_set_num_threads(1)  # what an earlier run on a busy machine leaves
        config = dpo_config(tiny_model_dir, tmp_path / "fresh", total_steps=1)
        history = DPOTrainer(config).train(preference_records(8, seed=0))
        assert seen == [most]
        assert history[-1]["rewards/chosen"] == 0.0 and history[-1]["rewards/margins"] == 0.0

        # A run on one thread stopped after step 1 (its checkpoint without the reference
        # cache), resumed with every thread free.
        seen.clear()
        records = preference_records(16, seed=0)
        with monkeypatch.context() as busy:
            busy.setitem(backend._OPENBLAS, "max_threads", 1)
            config = dpo_config(tiny_model_dir, tmp_path / "one_thread", save_every=1)
            DPOTrainer(config).train(records)
        step_1 = Path("checkpoints") / "step_000001"
        shutil.copytree(tmp_path / "one_thread" / step_1, tmp_path / "resumed" / step_1)
        lib.openblas_set_num_threads(most)
        config = dpo_config(tiny_model_dir, tmp_path / "resumed", save_every=1)
        DPOTrainer(config).train(records, resume_from="latest")
        assert seen == [1, 1]
    finally:
        backend.run_blas_threads(saved=start)


def _retrain_in_place(model_dir: Path) -> None:
    """New weights at the same path (the tokenizer unchanged): every weight moved a little."""
    path = model_dir / "model.safetensors"
    weights = cast(dict[str, mx.array], mx.load(str(path)))
    mx.save_safetensors(str(path), {k: v + 0.01 for k, v in weights.items()})


def test_a_retrained_reference_or_edited_data_is_refused_on_resume_before_any_reference_pass(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """issue #47: the reference log-prob cache was keyed by ref_model_name's path and the
    reference was not fingerprinted, so new weights at the same path were trained against on
    resume without a word; an edited data file was refused only after a full reference pass."""
    ref = tmp_path / "ref"
    shutil.copytree(tiny_model_dir, ref)
    records = preference_records(16, seed=3)
    cfg = dpo_config(tiny_model_dir, tmp_path / "run", ref_model_name=str(ref), total_steps=1)
    trainer = DPOTrainer(cfg)
    trainer.train(records)
    key_before = trainer._cache_path([])  # the key of no pairs: what the reference is

    def no_reference(self: DPOTrainer) -> ReferenceModel:
        raise AssertionError("the reference was loaded before the inputs were checked")

    longer = dpo_config(tiny_model_dir, tmp_path / "run", ref_model_name=str(ref), total_steps=2)
    with monkeypatch.context() as patch:
        patch.setattr(DPOTrainer, "reference", no_reference)
        edited = [dict(r) for r in records]
        edited[0]["chosen"] = edited[0]["chosen"] + " (edited)"
        with pytest.raises(ValueError, match="the training data"):
            DPOTrainer(longer).train(edited, resume_from="latest")
        _retrain_in_place(ref)
        with pytest.raises(ValueError, match=r"the reference model \(ref_model_name\)"):
            DPOTrainer(longer).train(records, resume_from="latest")
    # The cache is keyed by the reference's fingerprint, not its path.
    assert DPOTrainer(longer)._cache_path([]) != key_before


def test_callbacks_see_steps_evaluations_saves_and_can_stop_the_run(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    class Recorder(StageCallback):
        def __init__(self) -> None:
            self.events: list[tuple[str, int]] = []

        def on_train_begin(self, trainer: Any) -> None:
            self.events.append(("begin", trainer.global_step))

        def on_step_end(self, trainer: Any, step: int, metrics: dict[str, Any]) -> None:
            self.events.append(("step", step))
            assert "rewards/accuracies" in metrics
            if step == 2:
                trainer.request_stop("early stopping")

        def on_evaluate(self, trainer: Any, step: int, metrics: dict[str, float]) -> None:
            assert "eval/rewards/accuracies" in metrics
            self.events.append(("evaluate", step))

        def on_save(self, trainer: Any, step: int, path: Path) -> None:
            assert path.is_dir()
            self.events.append(("save", step))

        def on_train_end(self, trainer: Any, history: list[dict[str, Any]]) -> None:
            self.events.append(("end", trainer.global_step))

    recorder = Recorder()
    trainer = DPOTrainer(dpo_config(tiny_model_dir, tmp_path, eval_every=1, total_steps=4))
    records, held_out = preference_records(32, seed=0), preference_records(4, seed=8)
    trainer.train(records, held_out, callbacks=[recorder])
    assert recorder.events == [
        ("begin", 0),
        ("evaluate", 0),
        ("evaluate", 1),
        ("step", 1),
        ("evaluate", 2),
        ("step", 2),
        ("save", 2),  # the stop saves a checkpoint
        ("end", 2),
    ]
    assert trainer.stop_reason == "early stopping"
    with pytest.raises(ValueError, match="call it from a callback"):
        trainer.request_stop()


@pytest.mark.plots
@pytest.mark.slow
def test_run_dpo_writes_metrics_curves_and_a_model_that_generates_chats_and_exports(
    tiny_model_dir: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    data = write_jsonl(tmp_path / "prefs.jsonl", preference_records(40, seed=3))
    cfg = dpo_config(
        tiny_model_dir,
        tmp_path / "run",
        dataset=str(data),
        eval_fraction=0.2,
        eval_every=2,
        num_epochs=2,
    )
    out = run_dpo(cfg)
    assert out == tmp_path / "run" / "model"
    records = read_metrics(tmp_path / "run" / METRICS_FILE)
    assert [r["step"] for r in records] == list(range(9))
    for key in ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins"):
        assert key in records[-1] and f"eval/{key}" in records[-1]
    assert "logps/chosen" in records[-1] and "logps/rejected" in records[-1]
    assert records[-1]["eval/rewards/margins"] > records[0]["eval/rewards/margins"]
    assert (tmp_path / "run" / PLOT_FILE).stat().st_size > 0
    assert load_config(tmp_path / "run" / "config.yaml", cls=DPOConfig) == cfg

    from main import main

    assert main(["generate", "--model", str(tmp_path / "run"), "--prompt", "Review of",
                 "--max-tokens", "4", "--no-chat"]) == 0  # fmt: skip
    # chat: the first turn's greedy reply is what generate answers the message through the
    # chat template, from the same trained model.
    capsys.readouterr()
    assert main(["generate", "--model", str(tmp_path / "run"), "--prompt", "Hello there",
                 "--max-tokens", "5", "--chat"]) == 0  # fmt: skip
    reply = capsys.readouterr().out.rstrip("\n")
    assert reply
    monkeypatch.setattr(sys, "stdin", io.StringIO("Hello there\n/exit\n"))
    assert main(["chat", "--model", str(tmp_path / "run"), "--max-tokens", "5"]) == 0
    assert f"> {reply}\n" in capsys.readouterr().out
    assert main(["export", str(tmp_path / "run"), "--out", str(tmp_path / "export")]) == 0
    assert (tmp_path / "export" / "README.md").is_file()


def test_a_reference_with_another_tokenizer_is_refused(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    from fixtures.tiny_model import build_tiny_checkpoint

    other = build_tiny_checkpoint(tmp_path / "other", size="demo", seed=0)  # 1024 tokens
    cfg = dpo_config(tiny_model_dir, tmp_path / "run", ref_model_name=str(other))
    with pytest.raises(ValueError, match="uses another tokenizer than the policy"):
        DPOTrainer(cfg).train(preference_records(8, seed=0))
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_a_held_out_split_of_a_few_pairs_is_warned(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """issue #47: the default 5% of a 16-pair file is 1 pair, whose eval accuracy (0 or 1)
    read 1.000 without a word."""
    from finetune.records import load_preference_data
    from finetune.supervised_trainer import load_run_data

    data = write_jsonl(tmp_path / "pairs.jsonl", preference_records(16, seed=0))
    with caplog.at_level("WARNING", logger="ppo_mlx"):
        train, held_out = load_run_data(
            DPOConfig(model_name="m", dataset=str(data)), load_preference_data
        )
    assert held_out is not None and (len(train), len(held_out)) == (15, 1)
    assert "eval_fraction=0.05 holds out 1 of 16 records" in caplog.text
    caplog.clear()
    big = write_jsonl(tmp_path / "more.jsonl", preference_records(200, seed=0))
    with caplog.at_level("WARNING", logger="ppo_mlx"):
        load_run_data(DPOConfig(model_name="m", dataset=str(big)), load_preference_data)
    assert "holds out" not in caplog.text  # 10 pairs: enough to say nothing


def test_dpo_config_validation() -> None:
    base: dict[str, Any] = dict(model_name="m")
    assert DPOConfig(**base).needs_reference
    assert not DPOConfig(**base, loss_type="simpo").needs_reference
    for bad, message in (
        ({"beta": 0.0}, "beta must be > 0"),
        ({"label_smoothing": 0.5}, "label_smoothing must be in"),
        ({"label_smoothing": 0.1, "loss_type": "hinge"}, "has no effect"),
        ({"loss_type": "kto"}, "loss_type"),
        ({"simpo_gamma": -1.0}, "simpo_gamma"),
    ):
        with pytest.raises(ValueError, match=message):
            DPOConfig(**base, **bad)


@pytest.mark.slow
def test_main_dpo_command_and_config_listing(tiny_model_dir: Path, tmp_path: Path) -> None:
    from main import main

    data = write_jsonl(tmp_path / "prefs.jsonl", preference_records(16, seed=4))
    out = tmp_path / "run"
    code = main(
        ["dpo", "--data", str(data), "--set", f"model_name={tiny_model_dir}",
         "--set", f"output_dir={out}", "--set", "total_steps=2", "--set", "batch_size=8",
         "--set", "progress_bar=false", "--set", "eval_fraction=0"]
    )  # fmt: skip
    assert code == 0 and (out / "model" / "config.json").is_file()
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"prompt": "p", "chosen": "a", "rejected": "a"}])
    code = main(["dpo", "--data", str(bad), "--set", f"model_name={tiny_model_dir}",
                 "--set", f"output_dir={tmp_path / 'bad'}"])  # fmt: skip
    assert code == 2
    from config.reference import keys_text

    assert "loss_type = sigmoid" in keys_text("dpo")


@pytest.mark.slow
def test_demo_dpo_branch_runs(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    result = subprocess.run(
        [sys.executable, str(ROOT / "main.py"), "demo", "--dpo", "--smoke",
         "--output-dir", str(tmp_path / "demo")],
        capture_output=True, text=True, env=env, timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert "held-out preference accuracy" in result.stdout
    assert "mean reward of samples" in result.stdout
