"""Only the policy's tokens are actions: a hand-written two-turn episode through the RL math.

Row 0 of every case is the episode ``a0 a1 | c0 c1 | a2 a3 | pad``: two policy turns (columns
0-1 and 4-5) with two tool/environment tokens between them (columns 2-3) and one pad (column 6).
Its action mask is ``1 1 0 0 1 1 0``. Row 1 is a one-turn episode ``a0 a1 a2 | pad ...``.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np
import pytest

from advantage.gae_advantage import compute_gae
from reward_kl.reward_computer import add_action_rewards, per_token_rewards
from training.policy_loss import entropy_bonus, grpo_policy_loss, ppo_policy_loss
from training.value_loss import clipped_value_loss

MASK = mx.array([[1, 1, 0, 0, 1, 1, 0], [1, 1, 1, 0, 0, 0, 0]], dtype=mx.float32)
CONTEXT = np.array([[0, 0, 1, 1, 0, 0, 0], [0, 0, 0, 0, 0, 0, 0]], dtype=bool)
TURN_ENDS = mx.array([[1, 5], [2, -1]], dtype=mx.int32)
GAMMA, LAM = 0.9, 0.8


def test_action_rewards_land_on_each_turns_last_token() -> None:
    rewards = mx.zeros((2, 7))
    out = add_action_rewards(rewards, mx.array([[0.5, 2.0], [3.0, 0.0]]), TURN_ENDS)
    expected = np.zeros((2, 7))
    expected[0, 1], expected[0, 5], expected[1, 2] = 0.5, 2.0, 3.0
    np.testing.assert_allclose(np.array(out), expected)
    with pytest.raises(ValueError, match="turn_ends has shape"):
        add_action_rewards(rewards, mx.zeros((2, 2)), TURN_ENDS[:, :1])


def test_action_rewards_refuse_shapes_that_do_not_fit() -> None:
    def refused(rewards: mx.array, action_rewards: mx.array, ends: mx.array) -> str:
        with pytest.raises(ValueError) as raised:
            add_action_rewards(rewards, action_rewards, ends)
        return str(raised.value)

    assert refused(mx.zeros((7,)), mx.zeros((2, 2)), TURN_ENDS) == (
        "rewards must have shape (B, T), got (7,)"
    )
    assert refused(mx.zeros((2, 7)), mx.zeros((2,)), TURN_ENDS[:, 0]) == (
        "action_rewards must have shape (B, K), got (2,)"
    )
    # 3 episodes of 2 turns against 2 rows of rewards (K == B: the rows, not the turns, count)
    three = mx.zeros((3, 2), dtype=mx.int32)
    assert refused(mx.zeros((2, 7)), mx.zeros((3, 2)), three) == (
        "action_rewards has 3 rows but rewards has 2; one row per episode"
    )
    assert refused(mx.zeros((2, 3)), mx.zeros((3, 2)), three) == (
        "action_rewards has 3 rows but rewards has 2; one row per episode"
    )


def test_gae_of_a_two_turn_episode_bootstraps_across_the_tool_tokens() -> None:
    """Per-token rewards (KL on actions, score on the last policy token, per-action rewards on
    each turn's end) and GAE, against the recursion written out by hand for row 0."""
    kl = mx.array(np.linspace(0.1, 0.7, 14).reshape(2, 7), dtype=mx.float32)
    values = mx.array(np.linspace(-1.0, 1.0, 14).reshape(2, 7), dtype=mx.float32)
    kl_coef, score, r1, r2 = 0.2, 1.5, 0.25, -0.5
    rewards, _ = per_token_rewards(mx.array([score, 0.0]), kl, MASK, kl_coef)
    rewards = add_action_rewards(rewards, mx.array([[r1, r2], [0.0, 0.0]]), TURN_ENDS)
    adv, ret = compute_gae(rewards, values, MASK, GAMMA, LAM)

    k, v = np.array(kl)[0].astype(np.float64), np.array(values)[0].astype(np.float64)
    # Rewards of row 0: the KL penalty on the 4 actions, r1 at column 1, r2 + score at 5.
    R = {0: -kl_coef * k[0], 1: -kl_coef * k[1] + r1, 4: -kl_coef * k[4], 5: -kl_coef * k[5]}
    R[5] += r2 + score
    np.testing.assert_allclose(np.array(rewards)[0], [R[0], R[1], 0, 0, R[4], R[5], 0], rtol=1e-6)
    d5 = R[5] - v[5]  # terminal after the last policy token
    d4 = R[4] + GAMMA * v[5] - v[4]
    d1 = R[1] + GAMMA * v[4] - v[1]  # the next state after turn 1 is column 4 (tool tokens skipped)
    d0 = R[0] + GAMMA * v[1] - v[0]
    a5 = d5
    a4 = d4 + GAMMA * LAM * a5
    a1 = d1 + GAMMA * LAM * a4
    a0 = d0 + GAMMA * LAM * a1
    np.testing.assert_allclose(np.array(adv)[0], [a0, a1, 0, 0, a4, a5, 0], rtol=1e-5, atol=1e-6)
    returns = [a0 + v[0], a1 + v[1], 0, 0, a4 + v[4], a5 + v[5], 0]
    np.testing.assert_allclose(np.array(ret)[0], returns, rtol=1e-5, atol=1e-6)


def _with_context(x: np.ndarray, fill: np.ndarray) -> mx.array:
    """``x`` with its context (tool) positions replaced by ``fill``'s."""
    return mx.array(np.where(CONTEXT, fill, x).astype(np.float32))


def test_context_tokens_weigh_nothing_in_the_losses() -> None:
    """Policy loss (PPO, GRPO with its KL), entropy bonus and value loss: whatever the arrays
    hold at the tool tokens, the losses and their gradients there are those of zeros."""
    rng = np.random.default_rng(0)
    shape = (2, 7)
    new, old, ref, adv, ent = (rng.normal(size=shape) * 0.3 for _ in range(5))
    vpred, vold, ret = (rng.normal(size=shape) for _ in range(3))
    junk = rng.normal(size=shape) * 50

    def losses(fill: np.ndarray) -> tuple[list[float], np.ndarray]:
        def total(logprobs: mx.array) -> mx.array:
            ppo, _ = ppo_policy_loss(
                logprobs, _with_context(old, fill), _with_context(adv, fill), MASK, 0.2
            )
            grpo, _ = grpo_policy_loss(
                logprobs,
                _with_context(old, fill),
                _with_context(ref, fill),
                mx.array([0.7, -0.3]),
                MASK,
                0.2,
                0.05,
            )
            bonus, _ = entropy_bonus(ppo, {}, _with_context(ent, fill), MASK, 0.01)
            return ppo + grpo + bonus

        logprobs = _with_context(new, fill)
        value, grad = mx.value_and_grad(total)(logprobs)
        vloss, _ = clipped_value_loss(
            _with_context(vpred, fill),
            _with_context(vold, fill),
            _with_context(ret, fill),
            MASK,
            0.2,
        )
        return [float(np.array(value)), float(np.array(vloss))], np.array(grad)

    clean, clean_grad = losses(np.zeros(shape))
    dirty, dirty_grad = losses(junk)
    np.testing.assert_allclose(dirty, clean, rtol=1e-6)
    np.testing.assert_allclose(dirty_grad, clean_grad, rtol=1e-6, atol=1e-8)
    assert not dirty_grad[CONTEXT].any()


def _two_turn_rollout(algorithm: str) -> tuple[Any, Any]:
    """Rows 0-1 of this module's episodes as a :class:`Rollout`, with per-action rewards."""
    from ppo_trainer.experience import ExperienceSettings
    from ppo_trainer.generator import GenerationOutput
    from ppo_trainer.rollout import Rollout

    B, T = MASK.shape
    zeros = mx.zeros((B, T))
    gen = GenerationOutput(
        responses=mx.zeros((B, T), dtype=mx.int32),
        lengths=mx.array([6, 3]),
        ended_with_stop=mx.array([True, True]),
        logprobs=zeros,
        entropy=zeros,
        action_mask=MASK,
        turn_spans=[[(0, 2), (4, 6)], [(0, 3)]],
    )
    rollout = Rollout(
        texts=["a", "b"],
        completions=["a", "b"],
        prompt_ids=[[1], [1]],
        generation=gen,
        query_responses=mx.zeros((B, T + 1), dtype=mx.int32),
        prompt_lengths=mx.array([1, 1]),
        mask=MASK,
        logprobs=zeros,
        ref_logprobs=zeros,
        entropy=zeros,
        values=zeros if algorithm == "ppo" else None,
        scores=mx.array([1.5, 0.5]),
        action_rewards=mx.array([[0.25, -0.5], [3.0, 0.0]]),
        turn_ends=TURN_ENDS,
    )
    settings = ExperienceSettings(
        algorithm=algorithm,
        kl_estimator="k1",
        gamma=1.0,
        lam=1.0,
        whiten_rewards=False,
        whiten_advantages=False,
        group_size=2 if algorithm != "ppo" else 1,
        beta=0.0,
        grpo_advantage_scale="group",
        missing_eos_penalty=None,
    )
    return rollout, settings


def test_make_experience_places_per_action_rewards() -> None:
    """PPO: each turn's reward on its last token, the score on the last policy token, returns
    (gamma = lam = 1, V = 0) the sums of what follows; GRPO: the rewards summed into the score."""
    from ppo_trainer.experience import make_experience

    rollout, settings = _two_turn_rollout("ppo")
    batch, stats = make_experience(rollout, settings, 0.0, step=1)
    expected = [[0, 0.25, 0, 0, 0, 1.0, 0], [0, 0, 3.5, 0, 0, 0, 0]]
    np.testing.assert_allclose(np.array(stats["rewards"]), expected)
    assert batch.returns is not None
    np.testing.assert_allclose(
        np.array(batch.returns), [[1.25, 1.25, 0, 0, 1.0, 1.0, 0], [3.5, 3.5, 3.5, 0, 0, 0, 0]]
    )
    rollout, settings = _two_turn_rollout("grpo")
    batch, _ = make_experience(rollout, settings, 0.0, step=1)
    np.testing.assert_allclose(np.array(batch.scores), [1.25, 3.5])
