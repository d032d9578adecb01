"""Online DPO (algorithms/online_dpo.py): pairs of the policy's own samples, ranked by the
reward, learned with DPO's gradient (advantage/online_dpo.py)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten

from advantage.online_dpo import ONLINE_DPO_LOSSES, online_dpo_advantages, online_dpo_metrics
from config.ppo_config import PPOConfig
from models.policy_model import PolicyModel
from models.sft_model import ReferenceModel
from ppo_trainer.ppo_trainer import PPOTrainer
from tests.test_distill import (
    teacher_dir,
)  # noqa: F401  (a fixture: weights other than the policy's)
from tests.test_ppo_trainer import assert_all_changed, e_rate, make_config, trainable
from token_attribution.sequences import (
    build_query_responses,
    response_logprobs,
    response_positions,
)
from training.policy_loss import rloo_policy_loss
from training.preference_loss import preference_loss

PROMPTS = ["Review of the film:", "Review of the book:", "Review of the phone:", "Review of a bag:"]


def test_advantages_equal_a_naive_loop() -> None:
    rng = np.random.default_rng(0)
    log_ratio = rng.normal(size=(6, 4)).astype(np.float32)
    mask = (rng.random((6, 4)) > 0.3).astype(np.float32)
    scores = np.array([1.0, 0.0, 0.2, 0.7, 0.5, 0.5], dtype=np.float32)  # the last pair ties
    beta = 0.3
    got = np.array(
        online_dpo_advantages(mx.array(scores), mx.array(log_ratio), mx.array(mask), beta)
    )
    h = (log_ratio * mask).sum(axis=1)
    want = np.zeros(6)
    for p in range(3):
        a, b = 2 * p, 2 * p + 1
        if scores[a] == scores[b]:
            continue
        c, r = (a, b) if scores[a] > scores[b] else (b, a)
        w = 2 * beta / (1 + math.exp(beta * (h[c] - h[r])))  # 2 beta sigmoid(-beta Delta)
        want[c], want[r] = w, -w
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)
    with pytest.raises(ValueError, match="even number of samples"):
        online_dpo_advantages(
            mx.array(scores[:5]), mx.array(log_ratio[:5]), mx.array(mask[:5]), 1.0
        )


def test_the_update_follows_dpos_gradient_on_the_pairs(
    tiny_model_dir: Path, teacher_dir: Path  # noqa: F811
) -> None:
    """On the same two pairs, the sequence loss with these advantages has, at the sampling
    policy, the gradient of DPO's sigmoid loss ``mean_p -log sigmoid(beta (h_c - h_r))``."""
    policy = PolicyModel.from_pretrained(tiny_model_dir)
    reference = ReferenceModel.from_pretrained(teacher_dir)
    tok = policy.tokenizer
    prompts = [
        tok.encode(p) for p in ("Review of the film:", "Review of the book:") for _ in (0, 1)
    ]
    responses = mx.array(np.random.default_rng(0).integers(10, 300, (4, 5)))  # (4, 5) token ids
    scores = mx.array([0.2, 0.9, 0.8, 0.1])  # pair 0 prefers its second, pair 1 its first
    mask = mx.ones(responses.shape)
    beta = 0.5
    qr, lengths = build_query_responses(prompts, responses, int(tok.pad_token_id))
    positions = response_positions(lengths, responses.shape[1])
    ref_lp, _ = response_logprobs(reference, qr, positions, responses)

    def logps(model: nn.Module) -> mx.array:
        # nn.value_and_grad puts the traced weights into policy.model, which the wrapper runs.
        return response_logprobs(policy, qr, positions, responses)[0]  # (4, 5)

    def dpo_loss(model: nn.Module) -> mx.array:
        h = (logps(model) - ref_lp).sum(axis=1)  # (4,)
        delta = mx.array([-1.0, 1.0]) * (h[0::2] - h[1::2])  # h_c - h_r per pair
        return -nn.log_sigmoid(beta * delta).mean()

    old = mx.stop_gradient(logps(policy.model))
    advantages = online_dpo_advantages(scores, old - ref_lp, mask, beta)

    def surrogate(model: nn.Module) -> mx.array:
        return rloo_policy_loss(logps(model), old, advantages, mask, 0.2)[0]

    want = dict(tree_flatten(nn.value_and_grad(policy.model, dpo_loss)(policy.model)[1]))
    got = dict(tree_flatten(nn.value_and_grad(policy.model, surrogate)(policy.model)[1]))
    assert want.keys() == got.keys()
    for name in want:
        np.testing.assert_allclose(np.array(got[name]), np.array(want[name]), atol=1e-6, rtol=1e-4)
    assert max(float(mx.abs(g).max()) for g in want.values()) > 1e-4


@pytest.mark.parametrize("loss_type", ONLINE_DPO_LOSSES)
def test_each_loss_follows_the_offline_dpo_losss_gradient(
    loss_type: str, tiny_model_dir: Path, teacher_dir: Path  # noqa: F811
) -> None:
    """For every loss_type, the sequence loss with these advantages has, at the sampling
    policy, the gradient of the dpo stage's own loss (``training.preference_loss``) on the
    same pairs: summed answer log-probs, answer lengths (ipo averages), the chosen by score.
    The responses have different lengths, so ipo's averaging shows."""
    policy = PolicyModel.from_pretrained(tiny_model_dir)
    reference = ReferenceModel.from_pretrained(teacher_dir)
    tok = policy.tokenizer
    prompts = [
        tok.encode(p) for p in ("Review of the film:", "Review of the book:") for _ in (0, 1)
    ]
    responses = mx.array(np.random.default_rng(1).integers(10, 300, (4, 6)))  # (4, 6) token ids
    lengths_of = mx.array([6, 3, 5, 2])  # (4,) each response's tokens
    mask = (mx.arange(6)[None, :] < lengths_of[:, None]).astype(mx.float32)  # (4, 6)
    scores = mx.array([0.2, 0.9, 0.8, 0.1])  # pair 0 prefers its second, pair 1 its first
    chosen, rejected = mx.array([1, 2]), mx.array([0, 3])
    beta = 0.5
    qr, lengths = build_query_responses(prompts, responses, int(tok.pad_token_id))
    positions = response_positions(lengths, responses.shape[1])
    ref_lp, _ = response_logprobs(reference, qr, positions, responses)
    ref_sum = (ref_lp * mask).sum(axis=1)  # (4,)

    def logps(model: nn.Module) -> mx.array:
        return response_logprobs(policy, qr, positions, responses)[0]  # (4, 6)

    def offline(model: nn.Module) -> mx.array:
        s = (logps(model) * mask).sum(axis=1)  # (4,) summed answer log-probs
        n = mask.sum(axis=1)
        loss, _ = preference_loss(
            loss_type,  # type: ignore[arg-type]
            s[chosen],
            s[rejected],
            ref_sum[chosen],
            ref_sum[rejected],
            n[chosen],
            n[rejected],
            beta=beta,
        )
        return loss

    old = mx.stop_gradient(logps(policy.model))
    advantages = online_dpo_advantages(scores, (old - ref_lp) * mask, mask, beta, loss_type)

    def surrogate(model: nn.Module) -> mx.array:
        return rloo_policy_loss(logps(model), old, advantages, mask, 0.2)[0]

    want = dict(tree_flatten(nn.value_and_grad(policy.model, offline)(policy.model)[1]))
    got = dict(tree_flatten(nn.value_and_grad(policy.model, surrogate)(policy.model)[1]))
    assert want.keys() == got.keys()
    largest = max(float(mx.abs(g).max()) for g in want.values())
    assert largest > 1e-4
    for name in want:  # float32 sums in two orders: agreement to 1e-5 of the largest entry
        np.testing.assert_allclose(
            np.array(got[name]), np.array(want[name]), atol=1e-5 * largest, rtol=1e-4
        )


def test_pair_metrics_by_hand() -> None:
    """TRL's names and meanings: the first sample is chosen on a tie, rewards are beta times
    the summed log-ratio, log-probs summed over the action tokens."""
    scores = mx.array([1.0, 0.0, 0.5, 0.5, 0.0, 2.0])  # pair 1 ties: its first is chosen
    logprobs = mx.array(
        [[-1.0, -2.0], [-1.0, -9.0], [-3.0, 0.0], [-1.0, 0.0], [-2.0, -2.0], [-1.0, -1.0]]
    )
    log_ratio = mx.array([[0.5, 0.5], [0.0, 9.0], [-1.0, 0.0], [1.0, 0.0], [0.2, 0.2], [0.1, 0.0]])
    mask = mx.array([[1.0, 1.0], [1.0, 0.0], [1.0, 0.0], [1.0, 0.0], [1.0, 1.0], [1.0, 1.0]])
    ended = mx.array([True, False, True, True, False, True])
    got = {
        k: float(v)
        for k, v in online_dpo_metrics(scores, logprobs, log_ratio, mask, ended, 0.5).items()
    }
    # chosen: rows 0, 2, 5 (h 1.0, -1.0, 0.1; logps -3, -3, -2); rejected: 1, 3, 4 (h 0, 1, 0.4)
    want = {
        "rewards/chosen": 0.5 * (1.0 - 1.0 + 0.1) / 3,
        "rewards/rejected": 0.5 * (0.0 + 1.0 + 0.4) / 3,
        "rewards/margins": 0.5 * ((1.0 - 0.0) + (-1.0 - 1.0) + (0.1 - 0.4)) / 3,
        "rewards/accuracies": 1 / 3,
        "logps/chosen": (-3.0 - 3.0 - 2.0) / 3,
        "logps/rejected": (-1.0 - 1.0 - 4.0) / 3,
        "objective/scores_margin": (1.0 + 0.0 + 2.0) / 3,
        "val/contain_eos_token": 4 / 6,
        "beta": 0.5,
    }
    assert got == pytest.approx(want, rel=1e-6, abs=1e-7)


def test_loss_types_online_dpo_cannot_run_are_refused_with_the_list(tiny_model_dir: Path) -> None:
    for bad in ("robust", "simpo", "orpo", "dapo"):
        with pytest.raises(ValueError, match="loss_type sigmoid, ipo, hinge"):
            PPOConfig(model_name=str(tiny_model_dir), algorithm="online_dpo", loss_type=bad)
    with pytest.raises(ValueError, match="a DPO loss"):
        PPOConfig(model_name=str(tiny_model_dir), algorithm="grpo", group_size=4, loss_type="ipo")
    with pytest.raises(ValueError, match="online_dpo"):
        PPOConfig(model_name=str(tiny_model_dir), algorithm="ppo", loss_type="hinge")
    assert PPOConfig(model_name=str(tiny_model_dir), algorithm="online_dpo", loss_type="ipo")


def test_online_dpo_takes_trls_defaults_and_refuses_what_it_cannot_run(
    tiny_model_dir: Path,
) -> None:
    config = PPOConfig(model_name=str(tiny_model_dir), algorithm="online_dpo")
    assert (
        config.group_size,
        config.beta,
        config.num_ppo_epochs,
        config.temperature,
        config.loss_type,
    ) == (2, 0.1, 1, 0.9, "sigmoid")
    assert config.uses_reference_model
    for bad, message in (
        ({"group_size": 4}, "set group_size: 2"),
        ({"num_ppo_epochs": 2}, "num_ppo_epochs: 1"),
        ({"beta": 0.0}, "set beta"),
    ):
        with pytest.raises(ValueError, match=message):
            PPOConfig(model_name=str(tiny_model_dir), algorithm="online_dpo", **bad)


def test_online_dpo_trains_the_tiny_model_toward_the_preferred_samples(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """Pairs ranked by the share of 'e' (e_rate): every trainable weight moves, and the mean
    score of the policy's samples rises over the run."""
    config = make_config(
        tiny_model_dir,
        tmp_path,
        algorithm="online_dpo",
        num_ppo_epochs=1,
        batch_size=8,
        learning_rate=3e-2,
        use_lora=True,
        total_steps=25,
    )
    trainer = PPOTrainer(config, reward_model=e_rate)
    before = trainable(trainer.policy.model)
    history = trainer.train(PROMPTS * 50, num_epochs=1)
    assert len(history) == 25
    assert_all_changed(before, trainable(trainer.policy.model))
    scores = [m["objective/scores"] for m in history]
    assert np.mean(scores[-5:]) > np.mean(scores[:5]) + 0.1, scores  # measured: 0.10 -> 0.33


def test_a_judge_ranks_online_dpos_pairs(tiny_model_dir: Path, tmp_path: Path) -> None:
    config = make_config(
        tiny_model_dir,
        tmp_path,
        algorithm="online_dpo",
        num_ppo_epochs=1,
        use_lora=True,
        reward_funcs=[{"name": "judge", "model": str(tiny_model_dir), "scale": "yes/no"}],
    )
    trainer = PPOTrainer(config)
    before = trainable(trainer.policy.model)
    metrics: dict[str, Any] = trainer.step(PROMPTS)
    assert np.isfinite(metrics["objective/scores"])
    trl = ["rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins"]
    trl += ["logps/chosen", "logps/rejected", "objective/scores_margin", "objective/kl"]
    trl += ["objective/entropy", "val/contain_eos_token", "beta"]
    assert all(np.isfinite(metrics[k]) for k in trl), metrics
    assert metrics["beta"] == pytest.approx(0.1)
    assert metrics["objective/scores_margin"] >= 0
    assert_all_changed(before, trainable(trainer.policy.model))


@pytest.mark.slow
def test_a_resumed_online_dpo_run_equals_the_straight_run(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tests.resume_checks import assert_resume_equals_straight

    monkeypatch.setenv("PPO_MLX_ADAPTIVE_BLAS", "off")
    judge = [{"name": "judge", "model": str(tiny_model_dir), "scale": "yes/no"}]
    assert_resume_equals_straight(
        lambda name: PPOTrainer(
            make_config(
                tiny_model_dir,
                tmp_path / name,
                algorithm="online_dpo",
                num_ppo_epochs=1,
                reward_funcs=judge,
                save_every=100,
            )
        ),
        PROMPTS,
    )
