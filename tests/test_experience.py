"""make_experience (ppo_trainer/experience.py) on a batch small enough to write out by hand.

Four responses of at most three tokens, two per prompt. The expected rewards, KL, advantages and
returns are written out (one PPO case) or computed by the naive Python loops below, which share
nothing with the library: if the glue passes the wrong log-probs, flips the KL's sign, skips a
whitening or masks the wrong rows, a number here moves.
"""

from __future__ import annotations

import math
from typing import Any

import mlx.core as mx
import numpy as np
import pytest

from experience_buffer.buffer import RolloutBatch
from ppo_trainer.experience import ExperienceSettings, kl_per_token, make_experience
from ppo_trainer.generator import GenerationOutput
from ppo_trainer.rollout import Rollout
from reward_kl.reward_normalization import RunningMoments, update_moments

Rows = list[list[float]]

# Pad positions hold values far from the real ones (-9, 7): were one read, a result would move.
MASK: Rows = [[1, 1, 1], [1, 1, 0], [1, 0, 0], [1, 1, 1]]
LOGPROBS: Rows = [[-1.0, -0.5, -2.0], [-0.3, -1.2, -9.0], [-0.7, -9.0, -9.0], [-1.5, -0.2, -0.4]]
REF_LOGPROBS: Rows = [
    [-1.2, -0.4, -1.5],
    [-0.3, -1.0, -3.0],
    [-1.0, -3.0, -3.0],
    [-1.0, -0.6, -0.4],
]
VALUES: Rows = [[0.5, 0.2, -0.1], [0.1, 0.3, 7.0], [0.4, 7.0, 7.0], [-0.2, 0.0, 0.6]]
SCORES = [1.0, -0.5, 2.0, 0.0]
# Rows 1 and 3 ran out of budget (no stop token).
ENDED = [True, False, True, False]


def rollout(scores: list[float] = SCORES, values: Rows | None = VALUES, copies: int = 1) -> Rollout:
    """A rollout of the arrays above (B = 4, T = 3, prompts of 2 tokens); ``copies`` > 1 stacks
    that many copies of the batch (whole prompt groups each)."""
    B, T = len(MASK) * copies, len(MASK[0])

    def tiled(rows: Any) -> mx.array:
        return mx.array(list(rows) * copies)

    responses = mx.array([[10 + 3 * b + t for t in range(T)] for b in range(B)], dtype=mx.int32)
    generation = GenerationOutput(
        responses=responses,
        lengths=tiled([int(sum(row)) for row in MASK]).astype(mx.int32),
        ended_with_stop=tiled(ENDED),
    )
    query_responses = mx.concatenate([mx.full((B, 2), 1, dtype=mx.int32), responses], axis=1)
    return Rollout(
        texts=["p"] * B,
        completions=["c"] * B,
        prompt_ids=[[1, 1]] * B,
        generation=generation,
        query_responses=query_responses,
        prompt_lengths=mx.full((B,), 2, dtype=mx.int32),
        mask=tiled(MASK).astype(mx.float32),
        logprobs=tiled(LOGPROBS),
        ref_logprobs=tiled(REF_LOGPROBS),
        entropy=mx.zeros((B, T)),
        values=None if values is None else tiled(values),
        scores=tiled(scores),
    )


def settings(algorithm: str, **changes: Any) -> ExperienceSettings:
    base: dict[str, Any] = dict(
        algorithm=algorithm,
        kl_estimator="k1",
        gamma=1.0,
        lam=1.0,
        whiten_rewards=False,
        whiten_advantages=False,
        group_size=2,
        beta=0.0,
        grpo_advantage_scale="group",
        missing_eos_penalty=None,
        mask_truncated_completions=False,
    )
    base.update(changes)
    return ExperienceSettings(**base)


def listed(x: mx.array | None) -> Any:
    assert x is not None
    return np.array(x).tolist()


def close(actual: mx.array | None, expected: Any, atol: float = 1e-5) -> None:
    assert actual is not None
    np.testing.assert_allclose(np.array(actual), np.array(expected), rtol=1e-5, atol=atol)


# ---- naive references: plain Python over lists, valid tokens a prefix of each row ----


def n_valid(b: int) -> int:
    return int(sum(MASK[b]))


def naive_kl(estimator: str) -> Rows:
    out = []
    for b in range(len(MASK)):
        row = []
        for t in range(len(MASK[0])):
            d = LOGPROBS[b][t] - REF_LOGPROBS[b][t]
            value = {"k1": d, "k2": 0.5 * d * d, "k3": math.exp(-d) + d - 1.0}[estimator]
            row.append(value if MASK[b][t] else 0.0)
        out.append(row)
    return out


def naive_rewards(scores: list[float], kl: Rows, coef: float) -> tuple[Rows, Rows]:
    """(rewards, non_score): -coef * kl on every action token, the score on the last one."""
    rewards, non_score = [], []
    for b, row in enumerate(kl):
        penalty = [-coef * k if MASK[b][t] else 0.0 for t, k in enumerate(row)]
        non_score.append(penalty)
        rewards.append(
            [p + (scores[b] if t == n_valid(b) - 1 else 0.0) for t, p in enumerate(penalty)]
        )
    return rewards, non_score


def naive_whiten(x: Rows, shift_mean: bool = True) -> Rows:
    flat = [x[b][t] for b in range(len(x)) for t in range(n_valid(b))]
    mean = sum(flat) / len(flat)
    var = sum((v - mean) ** 2 for v in flat) / (len(flat) - 1)
    out = []
    for b, row in enumerate(x):
        new = []
        for t, v in enumerate(row):
            w = (v - mean) / math.sqrt(var + 1e-8) + (0.0 if shift_mean else mean)
            new.append(w if t < n_valid(b) else 0.0)
        out.append(new)
    return out


def naive_gae(rewards: Rows, values: Rows, gamma: float, lam: float) -> tuple[Rows, Rows]:
    advantages, returns = [], []
    for b, row in enumerate(rewards):
        n = n_valid(b)
        adv = [0.0] * len(row)
        running = 0.0
        for t in reversed(range(n)):
            next_value = values[b][t + 1] if t + 1 < n else 0.0
            delta = row[t] + gamma * next_value - values[b][t]
            running = delta + gamma * lam * running
            adv[t] = running
        advantages.append(adv)
        returns.append([adv[t] + values[b][t] if t < n else 0.0 for t in range(len(row))])
    return advantages, returns


def naive_returns(rewards: Rows, gamma: float) -> Rows:
    out = []
    for b, row in enumerate(rewards):
        g = [0.0] * len(row)
        running = 0.0
        for t in reversed(range(n_valid(b))):
            running = row[t] + gamma * running
            g[t] = running
        out.append(g)
    return out


def naive_group_advantages(scores: list[float], g: int, scale: str) -> list[float]:
    out = []
    mean_all = sum(scores) / len(scores)
    std_all = math.sqrt(sum((s - mean_all) ** 2 for s in scores) / (len(scores) - 1))
    for start in range(0, len(scores), g):
        group = scores[start : start + g]
        mean = sum(group) / g
        std = math.sqrt(sum((s - mean) ** 2 for s in group) / (g - 1))
        for s in group:
            divisor = {"group": std + 1e-4, "batch": std_all + 1e-4, "none": 1.0}[scale]
            out.append((s - mean) / divisor)
    return out


def penalised(scores: list[float], penalty: float) -> list[float]:
    return [s - (0.0 if ended else penalty) for s, ended in zip(scores, ENDED)]


# ---- PPO: per-token KL in the reward, GAE over the values ----


def test_ppo_by_hand() -> None:
    """k1 KL, kl_coef 0.1, gamma = lam = 1: rewards, advantages and returns written out."""
    batch, stats = make_experience(rollout(), settings("ppo"), 0.1, step=0)
    # k1 = logprobs - ref_logprobs on the action tokens, 0 on padding
    close(stats["kl"], [[0.2, -0.1, -0.5], [0.0, -0.2, 0.0], [0.3, 0.0, 0.0], [-0.5, 0.4, 0.0]])
    # the penalty -0.1 * kl: a positive KL lowers the reward
    close(
        stats["non_score"],
        [[-0.02, 0.01, 0.05], [0.0, 0.02, 0.0], [-0.03, 0.0, 0.0], [0.05, -0.04, 0.0]],
    )
    # plus the score on the last action token
    close(
        stats["rewards"],
        [[-0.02, 0.01, 1.05], [0.0, -0.48, 0.0], [1.97, 0.0, 0.0], [0.05, -0.04, 0.0]],
    )
    # gamma = lam = 1: A_t = (sum of the rewards from t on) - V_t, returns = A + V
    close(
        batch.advantages,
        [[0.54, 0.86, 1.15], [-0.58, -0.78, 0.0], [1.57, 0.0, 0.0], [0.21, -0.04, -0.6]],
    )
    close(
        batch.returns,
        [[1.04, 1.06, 1.05], [-0.48, -0.48, 0.0], [1.97, 0.0, 0.0], [0.01, -0.04, 0.0]],
    )
    # what the update reads: the rollout's own log-probs as the old ones, the reference's apart
    close(batch.logprobs, LOGPROBS)
    close(batch.ref_logprobs, REF_LOGPROBS)
    close(batch.values, VALUES)
    close(batch.mask, MASK)
    close(batch.scores, SCORES)
    r = rollout()
    assert listed(batch.query_responses) == listed(r.query_responses)
    assert listed(batch.prompt_lengths) == listed(r.prompt_lengths)
    assert listed(batch.responses) == listed(r.generation.responses)


def test_normalize_reward_feeds_the_rewards_normalised_scores_and_keeps_the_raw_ones() -> None:
    """``score_moments`` (normalize_reward): (score - running mean) / running std is the score
    in the rewards, and so in the advantages and returns; ``batch.scores`` stays the raw one."""
    moments = RunningMoments(count=8.0, mean=0.5, var=4.0)
    batch, stats = make_experience(rollout(), settings("ppo"), 0.1, step=0, score_moments=moments)
    normalised = [(s - 0.5) / 2.0 for s in SCORES]
    rewards, _ = naive_rewards(normalised, naive_kl("k1"), 0.1)
    close(stats["rewards"], rewards)
    same, _ = make_experience(rollout(normalised), settings("ppo"), 0.1, step=0)
    close(batch.advantages, listed(same.advantages))
    close(batch.returns, listed(same.returns))
    close(batch.scores, SCORES)


def test_scores_whose_statistics_overflow_stop_instead_of_normalising_to_zero() -> None:
    """Scores near 1e20 square past float32: an infinite running variance would turn every
    normalised score into 0 without a word; the step is named and nothing is made of it."""
    values = [1e20, -1e20] + [0.0] * (len(SCORES) - 2)
    moments = update_moments(RunningMoments(), mx.array(values))
    assert not math.isfinite(moments.var)
    with pytest.raises(ValueError, match="running mean and variance .* step 3 .*too large"):
        make_experience(
            rollout(values),
            settings("ppo"),
            0.1,
            step=3,
            score_moments=moments,
        )


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
@pytest.mark.parametrize("whiten_rewards", [False, True])
@pytest.mark.parametrize("whiten_advantages", [False, True])
def test_ppo_against_naive_loops(
    estimator: str, whiten_rewards: bool, whiten_advantages: bool
) -> None:
    config = settings(
        "ppo",
        kl_estimator=estimator,
        gamma=0.9,
        lam=0.8,
        whiten_rewards=whiten_rewards,
        whiten_advantages=whiten_advantages,
        beta=0.7,  # GRPO's weight: PPO must use kl_coef
    )
    batch, stats = make_experience(rollout(), config, 0.3, step=0)
    kl = naive_kl(estimator)
    rewards, non_score = naive_rewards(SCORES, kl, 0.3)
    close(stats["kl"], kl)
    close(stats["non_score"], non_score)
    close(stats["rewards"], rewards)  # before any whitening
    if whiten_rewards:
        rewards = naive_whiten(rewards, shift_mean=False)
    advantages, returns = naive_gae(rewards, VALUES, 0.9, 0.8)
    if whiten_advantages:
        advantages = naive_whiten(advantages)
    close(batch.advantages, advantages)
    close(batch.returns, returns)  # from the advantages before their whitening
    close(batch.values, VALUES)


def test_ppo_missing_eos_penalty_lowers_the_truncated_scores() -> None:
    batch, stats = make_experience(rollout(), settings("ppo", missing_eos_penalty=1.5), 0.1, step=0)
    scores = penalised(SCORES, 1.5)
    assert scores == [1.0, -2.0, 2.0, -1.5]
    close(batch.scores, scores)
    rewards, _ = naive_rewards(scores, naive_kl("k1"), 0.1)
    close(stats["rewards"], rewards)
    close(batch.advantages, naive_gae(rewards, VALUES, 1.0, 1.0)[0])


def test_kl_per_token_is_the_configured_estimator_except_for_grpo() -> None:
    close(kl_per_token(rollout(), settings("ppo", kl_estimator="k2")), naive_kl("k2"))
    close(kl_per_token(rollout(), settings("rloo", kl_estimator="k1")), naive_kl("k1"))
    close(kl_per_token(rollout(), settings("grpo", kl_estimator="k1")), naive_kl("k3"))


# ---- GRPO: group-relative advantages from the scores, the KL in the loss ----


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
@pytest.mark.parametrize("penalty", [None, 1.0])
def test_grpo_against_naive_loops(scale: str, penalty: float | None) -> None:
    config = settings(
        "grpo",
        kl_estimator="k1",  # GRPO's KL is k3 whatever this says
        grpo_advantage_scale=scale,
        beta=0.2,
        missing_eos_penalty=penalty,
    )
    batch, stats = make_experience(rollout(values=None), config, 5.0, step=0)
    scores = SCORES if penalty is None else penalised(SCORES, penalty)
    close(batch.scores, scores)
    close(batch.advantages, naive_group_advantages(scores, 2, scale), atol=1e-4)
    kl = naive_kl("k3")
    close(stats["kl"], kl)
    # beta, not kl_coef (5.0), weighs the KL of what GRPO's loss optimises
    rewards, non_score = naive_rewards(scores, kl, 0.2)
    close(stats["rewards"], rewards)
    close(stats["non_score"], non_score)
    assert batch.returns is None and batch.values is None
    close(batch.logprobs, LOGPROBS)
    close(batch.ref_logprobs, REF_LOGPROBS)
    close(batch.mask, MASK)


def test_grpo_by_hand() -> None:
    """Groups (1.0, -0.5) and (2.0, 0.0): centred +-0.75 and +-1.0, each std sqrt(2) times that."""
    batch, _ = make_experience(rollout(values=None), settings("grpo"), 0.0, step=0)
    s = math.sqrt(2.0)
    close(
        batch.advantages,
        [0.75 / (0.75 * s + 1e-4), -0.75 / (0.75 * s + 1e-4), 1 / (s + 1e-4), -1 / (s + 1e-4)],
    )
    batch, _ = make_experience(
        rollout(values=None), settings("grpo", grpo_advantage_scale="none"), 0.0, step=0
    )
    close(batch.advantages, [0.75, -0.75, 1.0, -1.0])


@pytest.mark.parametrize("algorithm", ["grpo", "rloo", "reinforce_pp_baseline"])
def test_mask_truncated_completions_masks_only_the_loss(algorithm: str) -> None:
    """Rows that ran out of budget leave the loss (mask all 0) but keep their part in the
    advantages of the others."""
    kept, _ = make_experience(rollout(values=None), settings(algorithm), 0.1, step=0)
    masked, _ = make_experience(
        rollout(values=None), settings(algorithm, mask_truncated_completions=True), 0.1, step=0
    )
    close(masked.mask, [MASK[0], [0, 0, 0], MASK[2], [0, 0, 0]])
    close(kept.mask, MASK)
    close(masked.advantages, kept.advantages)
    close(masked.scores, SCORES)


# ---- RLOO: leave-one-out baseline of score - kl_coef * sum(kl) ----


@pytest.mark.parametrize("estimator", ["k1", "k3"])
def test_rloo_against_naive_loops(estimator: str) -> None:
    config = settings("rloo", kl_estimator=estimator, beta=0.9)
    batch, stats = make_experience(rollout(values=None), config, 0.5, step=0)
    kl = naive_kl(estimator)
    totals = [SCORES[b] - 0.5 * sum(kl[b]) for b in range(4)]
    expected = [
        totals[b] - sum(totals[j] for j in range(4) if j // 2 == b // 2 and j != b)
        for b in range(4)
    ]
    close(batch.advantages, expected)
    close(stats["kl"], kl)
    close(stats["rewards"], naive_rewards(SCORES, kl, 0.5)[0])
    assert batch.returns is None


def test_rloo_by_hand() -> None:
    """k1 KL sums (-0.4, -0.2, 0.3, -0.1), kl_coef 1: R = (1.4, -0.3, 1.7, 0.1)."""
    batch, _ = make_experience(rollout(values=None), settings("rloo"), 1.0, step=0)
    close(batch.advantages, [1.7, -1.7, 1.6, -1.6])


# ---- REINFORCE++: whitened discounted returns of the per-token rewards ----


@pytest.mark.parametrize("estimator", ["k1", "k2"])
@pytest.mark.parametrize("penalty", [None, 0.5])
def test_reinforce_pp_against_naive_loops(estimator: str, penalty: float | None) -> None:
    config = settings(
        "reinforce_pp", kl_estimator=estimator, gamma=0.9, missing_eos_penalty=penalty
    )
    batch, stats = make_experience(rollout(values=None), config, 0.3, step=0)
    scores = SCORES if penalty is None else penalised(SCORES, penalty)
    rewards, _ = naive_rewards(scores, naive_kl(estimator), 0.3)
    close(stats["rewards"], rewards)
    returns = naive_returns(rewards, 0.9)
    close(batch.returns, returns)
    close(batch.advantages, naive_whiten(returns))


def test_reinforce_pp_baseline_against_naive_loops() -> None:
    """Group-centred scores, then undiscounted returns, whitened over the batch."""
    batch, stats = make_experience(
        rollout(values=None), settings("reinforce_pp_baseline", gamma=1.0), 0.3, step=0
    )
    centred = naive_group_advantages(SCORES, 2, "none")
    assert centred == [0.75, -0.75, 1.0, -1.0]
    rewards, _ = naive_rewards(centred, naive_kl("k1"), 0.3)
    returns = naive_returns(rewards, 1.0)
    close(batch.returns, returns)
    close(batch.advantages, naive_whiten(returns))
    # the stats' rewards are those of the raw scores (what the reward model said)
    close(stats["rewards"], naive_rewards(SCORES, naive_kl("k1"), 0.3)[0])


class TwoRanks:
    """A data-parallel group of two ranks that hold the same rows (``all_sum`` doubles)."""

    def size(self) -> int:
        return 2

    def rank(self) -> int:
        return 0


@pytest.mark.parametrize(
    "algorithm, changes",
    [
        ("ppo", {"whiten_rewards": True}),
        ("ppo", {"whiten_advantages": True}),
        ("grpo", {"grpo_advantage_scale": "batch"}),
        ("reinforce_pp", {"gamma": 0.9}),
        ("reinforce_pp_baseline", {}),
    ],
)
def test_batch_statistics_are_those_of_every_rank(
    algorithm: str, changes: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Whitening and GRPO's batch std of a data-parallel run use the global batch: on two ranks
    holding the same four rows, each rank's result is that of the eight rows on one process
    (the unbiased variance's n - 1 tells 4 rows from 8)."""
    values = VALUES if algorithm == "ppo" else None
    config = settings(algorithm, **changes)
    whole, _ = make_experience(rollout(values=values, copies=2), config, 0.3, step=0)
    monkeypatch.setattr(mx.distributed, "all_sum", lambda x, group=None, stream=None: 2 * x)
    rank, _ = make_experience(rollout(values=values), config, 0.3, step=0, group=TwoRanks())
    close(rank.advantages, np.array(whole.advantages)[:4])
    if whole.returns is not None:
        close(rank.returns, np.array(whole.returns)[:4])
    local, _ = make_experience(rollout(values=values), config, 0.3, step=0)
    assert not np.allclose(np.array(local.advantages), np.array(rank.advantages), atol=1e-4)


# ---- what the update gets ----


@pytest.mark.parametrize(
    "algorithm", ["ppo", "grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline"]
)
def test_every_algorithm_passes_the_rollout_through(algorithm: str) -> None:
    values = VALUES if algorithm == "ppo" else None
    batch, _ = make_experience(rollout(values=values), settings(algorithm), 0.1, step=0)
    assert isinstance(batch, RolloutBatch)
    close(batch.logprobs, LOGPROBS)
    close(batch.ref_logprobs, REF_LOGPROBS)
    close(batch.mask, MASK)
    close(batch.scores, SCORES)
    sequence_level = algorithm in ("grpo", "rloo")
    assert batch.advantages.shape == ((4,) if sequence_level else (4, 3))
    assert (batch.returns is None) == sequence_level


@pytest.mark.parametrize("algorithm, what", [("ppo", "returns"), ("reinforce_pp", "advantages")])
def test_scores_too_large_for_float32_are_refused(algorithm: str, what: str) -> None:
    """PPO's returns (squared by the value loss) and REINFORCE++'s whitening overflow."""
    values = VALUES if algorithm == "ppo" else None
    message = (
        rf"^the {what} of step 7 are not finite \(the largest \|score\| is 3e\+38\): the scores "
        r"are too large for float32 arithmetic. Scale or clip the reward \(e.g. into "
        r"\[-10, 10\]\); no update was made from this batch$"
    )
    with pytest.raises(ValueError, match=message):
        make_experience(
            rollout([3e38, 1.0, 2.0, 0.0], values=values), settings(algorithm), 0.1, step=7
        )


def test_ppo_without_values_is_a_bug() -> None:
    with pytest.raises(AssertionError, match="^PPO needs the rollout's values$"):
        make_experience(rollout(values=None), settings("ppo"), 0.1, step=0)


def test_unknown_algorithm_is_refused() -> None:
    with pytest.raises(ValueError, match="algorithm must be one of 'ppo', .*, got 'ppo2'"):
        make_experience(rollout(), settings("ppo2"), 0.1, step=0)


def test_settings_from_config() -> None:
    from config.ppo_config import PPOConfig

    config = PPOConfig(
        model_name="m",
        algorithm="grpo",
        group_size=4,
        beta=0.05,
        missing_eos_penalty=1.0,
        mask_truncated_completions=True,
        grpo_advantage_scale="batch",
    )
    got = ExperienceSettings.from_config(config)
    assert got == ExperienceSettings(
        algorithm="grpo",
        kl_estimator=config.kl_estimator,
        gamma=config.gamma,
        lam=config.lam,
        whiten_rewards=config.whiten_rewards,
        whiten_advantages=config.whiten_advantages,
        group_size=4,
        beta=0.05,
        grpo_advantage_scale="batch",
        missing_eos_penalty=1.0,
        mask_truncated_completions=True,
        loss_type="dapo",
    )
