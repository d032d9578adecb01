"""The update's inputs (ppo_trainer/update.py), against naive losses on a tiny bigram model.

The policy is a table of logits per previous token, so its log-probs, losses and gradients are
a few lines of numpy (float64) here. The rollout's old log-probs and the reference's differ from
the policy's and from each other: a loss that reads one in place of the other, the wrong
temperature, or the values in place of the returns gives another number.
"""

from __future__ import annotations

import math
from types import SimpleNamespace
from typing import Any, cast

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
import pytest

from experience_buffer.buffer import RolloutBatch
from ppo_trainer.update import (
    Learner,
    policy_loss_fn,
    policy_weighting,
    ppo_epochs,
    update_weights,
    value_loss_fn,
)
from token_attribution.sequences import gather_positions

V = 6  # vocabulary
PROMPT_LENGTHS = [2, 3, 1, 2]
MASK = np.array([[1, 1, 1], [1, 1, 0], [1, 0, 0], [1, 1, 1]], dtype=np.float32)
B, T = MASK.shape
MAX_NEW_TOKENS = 5


class Bigram(nn.Module):
    """Logits of the next token = a row of ``table`` picked by the current token."""

    def __init__(self, table: np.ndarray) -> None:
        super().__init__()
        self.table = mx.array(table.astype(np.float32))  # (V, V)

    def logits_at(self, input_ids: mx.array, positions: mx.array) -> mx.array:
        return self.table[gather_positions(input_ids, positions)]  # (B, T, V)

    def hidden_at(self, input_ids: mx.array, positions: mx.array) -> mx.array:
        raise AssertionError("no blockwise path: output_head is None")

    def output_head(self) -> Any:
        return None


class ValueTable(nn.Module):
    """The value of a position = ``weight[token at that position]``."""

    def __init__(self, weight: np.ndarray) -> None:
        super().__init__()
        self.weight = mx.array(weight.astype(np.float32))  # (V,)

    def __call__(self, input_ids: mx.array) -> mx.array:
        return self.weight[input_ids]  # (B, L)


RNG = np.random.default_rng(3)
TABLE = RNG.normal(size=(V, V))
VALUE_WEIGHT = RNG.normal(size=(V,))
RESPONSES = RNG.integers(0, V, size=(B, T))
QUERY_RESPONSES = np.zeros((B, max(PROMPT_LENGTHS) + T), dtype=np.int32)
for _b, _p in enumerate(PROMPT_LENGTHS):
    QUERY_RESPONSES[_b, :_p] = RNG.integers(0, V, size=_p)
    QUERY_RESPONSES[_b, _p : _p + T] = RESPONSES[_b]


def scoring_tokens() -> np.ndarray:
    """(B, T) the token whose outputs score (or value) response token t: position p_b - 1 + t."""
    return np.array(
        [[QUERY_RESPONSES[b, p - 1 + t] for t in range(T)] for b, p in enumerate(PROMPT_LENGTHS)]
    )


def naive_logprobs(table: np.ndarray, temperature: float) -> np.ndarray:
    out = np.zeros((B, T))
    for b in range(B):
        for t in range(T):
            logits = table[scoring_tokens()[b, t]] / temperature
            out[b, t] = logits[RESPONSES[b, t]] - math.log(np.exp(logits).sum())
    return out


TEMPERATURE = 0.7
# The policy's log-probs moved by up to 0.35 (ratios outside 1 +- 0.2: some are clipped), and
# the reference's by other amounts: each is told apart from the other by the losses.
OLD = naive_logprobs(TABLE, TEMPERATURE) + RNG.uniform(-0.35, 0.35, size=(B, T))
REF = naive_logprobs(TABLE, TEMPERATURE) + RNG.uniform(-0.6, 0.6, size=(B, T))
TOKEN_ADVANTAGES = RNG.normal(size=(B, T))
SEQUENCE_ADVANTAGES = np.array([1.2, -0.7, 0.4, -1.5])
OLD_VALUES = VALUE_WEIGHT[scoring_tokens()] + RNG.uniform(-0.3, 0.3, size=(B, T))
RETURNS = RNG.normal(size=(B, T))


def batch(sequence_advantages: bool) -> RolloutBatch:
    advantages = SEQUENCE_ADVANTAGES if sequence_advantages else TOKEN_ADVANTAGES
    return RolloutBatch(
        query_responses=mx.array(QUERY_RESPONSES),
        prompt_lengths=mx.array(PROMPT_LENGTHS, dtype=mx.int32),
        responses=mx.array(RESPONSES.astype(np.int32)),
        mask=mx.array(MASK),
        logprobs=mx.array(OLD.astype(np.float32)),
        ref_logprobs=mx.array(REF.astype(np.float32)),
        scores=mx.zeros((B,)),
        advantages=mx.array(advantages.astype(np.float32)),
        values=mx.array(OLD_VALUES.astype(np.float32)),
        returns=mx.array(RETURNS.astype(np.float32)),
    )


def config(algorithm: str, **changes: Any) -> SimpleNamespace:
    base: dict[str, Any] = dict(
        algorithm=algorithm,
        temperature=TEMPERATURE,
        clip_epsilon=0.2,
        clip_epsilon_high=None,
        beta=0.3,
        loss_type="bnpo",
        importance_sampling_level="token",
        max_new_tokens=MAX_NEW_TOKENS,
        vf_coef=0.4,
        cliprange_value=0.1,
        entropy_coef=0.0,
        think_loss_weight=1.0,
        answer_loss_weight=1.0,
        top_entropy_quantile=1.0,
        sft_coef=0.0,
    )
    base.update(changes)
    return SimpleNamespace(**base)


def surrogate(ratio: np.ndarray, advantages: np.ndarray, low: float, high: float) -> np.ndarray:
    return np.maximum(-advantages * ratio, -advantages * np.clip(ratio, 1 - low, 1 + high))


def naive_policy_loss(table: np.ndarray, cfg: SimpleNamespace, rows: list[int]) -> float:
    """The loss of ``cfg.algorithm`` over ``rows``, from the old and reference log-probs."""
    logp = naive_logprobs(table, cfg.temperature)[rows]
    old, ref, mask = OLD[rows], REF[rows], MASK[rows]
    low = cfg.clip_epsilon
    high = low if cfg.clip_epsilon_high is None else cfg.clip_epsilon_high
    valid = mask > 0
    if cfg.algorithm in ("ppo", "reinforce_pp"):
        per_token = surrogate(np.exp(logp - old), TOKEN_ADVANTAGES[rows], low, high)
        return float((per_token * top_entropy_keep(table, cfg, rows))[valid].mean())
    advantages = SEQUENCE_ADVANTAGES[rows][:, None]  # (b, 1)
    if cfg.algorithm == "rloo":
        ratio = np.exp(((logp - old) * mask).sum(axis=1, keepdims=True))
        return float(surrogate(ratio, advantages, low, high).mean())
    assert cfg.algorithm == "grpo"
    if cfg.importance_sampling_level == "token":
        per_token = surrogate(np.exp(logp - old), advantages, low, high)
    else:
        ratio = np.exp(
            ((logp - old) * mask).sum(axis=1, keepdims=True) / mask.sum(axis=1, keepdims=True)
        )
        per_token = np.broadcast_to(surrogate(ratio, advantages, low, high), logp.shape)
    d = ref - logp
    per_token = per_token + cfg.beta * (np.exp(d) - d - 1)  # k3 to the reference
    if cfg.loss_type == "grpo":
        return float(np.mean([per_token[b][valid[b]].mean() for b in range(len(rows))]))
    if cfg.loss_type == "dr_grpo":
        return float(per_token[valid].sum() / (len(rows) * MAX_NEW_TOKENS))
    return float(per_token[valid].mean())  # bnpo, dapo


def token_entropies(table: np.ndarray, temperature: float, rows: list[int]) -> np.ndarray:
    """(b, T) entropy of the sampling distribution at each response token of ``rows``."""
    logits = table[scoring_tokens()[rows]] / temperature  # (b, T, V)
    logp = logits - np.log(np.exp(logits).sum(axis=-1, keepdims=True))
    return -(np.exp(logp) * logp).sum(axis=-1)


def top_entropy_keep(table: np.ndarray, cfg: SimpleNamespace, rows: list[int]) -> np.ndarray:
    """(b, T) 1 on the action tokens whose entropy is at least the (1 - q)-quantile of theirs."""
    entropy, valid = token_entropies(table, cfg.temperature, rows), MASK[rows] > 0
    threshold = np.quantile(entropy[valid], 1.0 - cfg.top_entropy_quantile)
    return (entropy >= threshold).astype(np.float64)


def naive_entropy(table: np.ndarray, temperature: float, rows: list[int]) -> float:
    """The mean over the action tokens of ``rows`` of the sampling distribution's entropy."""
    logits = table[scoring_tokens()[rows]] / temperature  # (b, T, V)
    logp = logits - np.log(np.exp(logits).sum(axis=-1, keepdims=True))
    return float((-(np.exp(logp) * logp).sum(axis=-1))[MASK[rows] > 0].mean())


def naive_loss_with_bonus(table: np.ndarray, cfg: SimpleNamespace, rows: list[int]) -> float:
    bonus = cfg.entropy_coef * naive_entropy(table, cfg.temperature, rows)
    return naive_policy_loss(table, cfg, rows) - bonus


def naive_value_loss(weight: np.ndarray, cfg: SimpleNamespace, rows: list[int]) -> float:
    v = weight[scoring_tokens()[rows]]
    old, returns, valid = OLD_VALUES[rows], RETURNS[rows], MASK[rows] > 0
    clipped = np.clip(v, old - cfg.cliprange_value, old + cfg.cliprange_value)
    losses = np.maximum((v - returns) ** 2, (clipped - returns) ** 2)
    return float(cfg.vf_coef * 0.5 * losses[valid].mean())


def finite_difference(f: Any, x: np.ndarray, h: float = 1e-5) -> np.ndarray:
    grad = np.zeros_like(x)
    for index in np.ndindex(*x.shape):
        up, down = x.copy(), x.copy()
        up[index] += h
        down[index] -= h
        grad[index] = (f(up) - f(down)) / (2 * h)
    return grad


POLICY_CASES = [
    config("ppo"),
    config("ppo", clip_epsilon_high=0.3),
    config("reinforce_pp", clip_epsilon=0.1),
    config("rloo"),
    config("rloo", clip_epsilon_high=0.5),
    *[config("grpo", loss_type=lt) for lt in ("grpo", "bnpo", "dr_grpo", "dapo")],
    *[
        config("grpo", loss_type=lt, importance_sampling_level="sequence")
        for lt in ("grpo", "bnpo")
    ],
    config("grpo", beta=0.0, clip_epsilon_high=0.28),
    config("ppo", temperature=1.0),
    config("ppo", entropy_coef=0.5),
    config("grpo", entropy_coef=0.5),
    config("ppo", top_entropy_quantile=0.5),
]


@pytest.mark.parametrize(
    "cfg",
    POLICY_CASES,
    ids=lambda c: f"{c.algorithm}-{c.loss_type}-{c.importance_sampling_level}-"
    f"b{c.beta}-eh{c.clip_epsilon_high}-T{c.temperature}-H{c.entropy_coef}-"
    f"q{c.top_entropy_quantile}",
)
def test_policy_loss_reads_the_old_logprobs_and_the_reference(cfg: SimpleNamespace) -> None:
    """Value and gradient of ``policy_loss_fn(config)`` equal the naive loss's (float64 finite
    differences): the ratio is to the rollout's log-probs, GRPO's KL to the reference's."""
    sequence = cfg.algorithm in ("grpo", "rloo")
    policy = Bigram(TABLE)
    loss_fn = policy_loss_fn(cfg)
    (loss, metrics), grads = nn.value_and_grad(policy, loss_fn)(policy, batch(sequence))
    rows = list(range(B))
    assert float(loss) == pytest.approx(naive_loss_with_bonus(TABLE, cfg, rows), rel=1e-5, abs=1e-6)
    expected = finite_difference(lambda t: naive_loss_with_bonus(t, cfg, rows), TABLE)
    np.testing.assert_allclose(np.array(grads["table"]), expected, rtol=1e-3, atol=1e-4)
    assert np.abs(expected).max() > 0.01  # the gradient is not trivially zero
    # The entropy is computed (and reported) only for an entropy bonus.
    assert ("entropy" in metrics) == (cfg.entropy_coef > 0)
    if cfg.entropy_coef > 0:
        assert float(metrics["entropy"]) == pytest.approx(
            naive_entropy(TABLE, cfg.temperature, rows), rel=1e-5
        )
    if cfg.algorithm == "grpo":
        logp = naive_logprobs(TABLE, cfg.temperature)
        d = REF - logp
        assert float(metrics["kl"]) == pytest.approx(
            float((np.exp(d) - d - 1)[MASK > 0].mean()), rel=1e-5
        )


def test_the_three_logprobs_differ_enough_to_tell_apart() -> None:
    """Guards the test above: old, reference and current log-probs give different losses."""
    cfg = config("grpo")
    rows = list(range(B))
    current = naive_logprobs(TABLE, TEMPERATURE)
    assert np.abs(current - OLD).max() > 0.2 and np.abs(current - REF).max() > 0.3
    assert np.abs(OLD - REF).max() > 0.3
    ratio = np.exp(current - OLD)
    assert ((ratio > 1.2) | (ratio < 0.8))[MASK > 0].any()  # some tokens are clipped
    assert naive_policy_loss(TABLE, cfg, rows) != pytest.approx(
        naive_policy_loss(TABLE, config("grpo", beta=0.0), rows), abs=1e-3
    )


def test_value_loss_regresses_to_the_returns_around_the_rollout_values() -> None:
    cfg = config("ppo")
    model = ValueTable(VALUE_WEIGHT)
    (loss, metrics), grads = nn.value_and_grad(model, value_loss_fn(cfg))(model, batch(False))
    rows = list(range(B))
    assert float(loss) == pytest.approx(naive_value_loss(VALUE_WEIGHT, cfg, rows), rel=1e-5)
    expected = finite_difference(lambda w: naive_value_loss(w, cfg, rows), VALUE_WEIGHT)
    np.testing.assert_allclose(np.array(grads["weight"]), expected, rtol=1e-3, atol=1e-5)
    vpred = VALUE_WEIGHT[scoring_tokens()]
    assert float(metrics["vpred"]) == pytest.approx(float(vpred[MASK > 0].mean()), rel=1e-5)
    # the clip is active somewhere, so the rollout values matter
    assert (np.abs(vpred - OLD_VALUES)[MASK > 0] > cfg.cliprange_value).any()


@pytest.mark.parametrize(
    "algorithm, loss_type, expected",
    [
        ("ppo", "grpo", "bnpo"),
        ("reinforce_pp", "dapo", "bnpo"),
        ("reinforce_pp_baseline", "dr_grpo", "bnpo"),
        ("rloo", "bnpo", "grpo"),
        ("grpo", "dapo", "dapo"),
        ("grpo", "dr_grpo", "dr_grpo"),
        ("grpo", "grpo", "grpo"),
    ],
)
def test_policy_weighting(algorithm: str, loss_type: str, expected: str) -> None:
    assert policy_weighting(config(algorithm, loss_type=loss_type)) == expected


def test_update_weights_on_one_process() -> None:
    """Micro-batches of 3 + 2 and of 1 + 1 + 0 ... action tokens: a plain mean is 1/n each;
    DAPO's is each micro-batch's share of the update's tokens."""
    micro = [batch(False)[0:2], batch(False)[2:4]]  # 5 and 4 action tokens
    for weighting in ("bnpo", "grpo", "dr_grpo"):
        assert [float(w) for w in update_weights(micro, weighting, None)] == [0.5, 0.5]
    dapo = [float(w) for w in update_weights(micro, "dapo", None)]
    assert dapo == pytest.approx([5 / 9, 4 / 9])
    three = [batch(False)[0:1], batch(False)[1:3], batch(False)[3:4]]  # 3, 3 and 3 tokens
    assert [float(w) for w in update_weights(three, "dapo", None)] == pytest.approx([1 / 3] * 3)
    assert [float(w) for w in update_weights(three, "bnpo", None)] == pytest.approx([1 / 3] * 3)


class TwoRanks:
    """A data-parallel group of two ranks (its ``all_sum`` is monkeypatched in the test)."""

    def size(self) -> int:
        return 2


def test_update_weights_on_two_ranks(monkeypatch: pytest.MonkeyPatch) -> None:
    """This rank's micro-batches hold 5 and 4 action tokens, the other rank's 3 and 6: the token
    counts are all-reduced, so each weight is this rank's share of the global count."""
    other = mx.array([3.0, 6.0])
    monkeypatch.setattr(mx.distributed, "all_sum", lambda x, group=None, stream=None: x + other)
    micro = [batch(False)[0:2], batch(False)[2:4]]
    weights = {w: [float(x) for x in update_weights(micro, w, TwoRanks())] for w in
               ("bnpo", "dapo", "grpo", "dr_grpo")}  # fmt: skip
    # bnpo: R c_k / C_k / n with C = (8, 10); dapo: R c_k / sum(C); the sequence means: 1 / n
    assert weights["bnpo"] == pytest.approx([2 * 5 / 8 / 2, 2 * 4 / 10 / 2])
    assert weights["dapo"] == pytest.approx([2 * 5 / 18, 2 * 4 / 18])
    assert weights["grpo"] == weights["dr_grpo"] == pytest.approx([0.5, 0.5])


def test_ppo_epochs_steps_each_learner_on_its_own_loss() -> None:
    """Two epochs of two minibatches of two micro-batches: four metric dicts under TRL's names;
    the first minibatch's losses are the naive ones on its rows (mean over its micro-batches),
    and both models moved."""
    cfg = config("ppo")
    policy, value = Bigram(TABLE), ValueTable(VALUE_WEIGHT)
    learners = [
        Learner(policy, optim.SGD(0.1), nn.value_and_grad(policy, policy_loss_fn(cfg)), "policy"),
        Learner(value, optim.SGD(0.1), nn.value_and_grad(value, value_loss_fn(cfg)), "val"),
    ]
    metrics = ppo_epochs(
        batch(False),
        learners,
        num_ppo_epochs=2,
        num_mini_batches=2,
        gradient_accumulation_steps=2,
        max_grad_norm=math.inf,
        rng=np.random.default_rng(5),
        step=0,
    )
    assert len(metrics) == 4
    for m in metrics:
        assert {"loss/policy", "policy/clipfrac", "policy/approxkl", "clip_ratio/low_mean"} <= set(
            m
        )
        assert {"loss/value", "val/clipfrac", "val/vpred", "val/grad_norm"} <= set(m)
        assert not any(key.startswith(("policy/clip_ratio", "val/loss")) for key in m)
    first = np.random.default_rng(5).permutation(B)[:2].tolist()
    policy_loss = np.mean([naive_policy_loss(TABLE, cfg, [row]) for row in first])
    value_loss = np.mean([naive_value_loss(VALUE_WEIGHT, cfg, [row]) for row in first])
    assert float(metrics[0]["loss/policy"]) == pytest.approx(policy_loss, rel=1e-5)
    assert float(metrics[0]["loss/value"]) == pytest.approx(value_loss, rel=1e-5)
    assert not np.allclose(np.array(policy.table), TABLE, atol=1e-4)
    assert not np.allclose(np.array(value.weight), VALUE_WEIGHT, atol=1e-4)


def test_ppo_epochs_hands_each_step_its_learner_group_and_step(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """What reaches the optimiser step: each learner's model, optimiser and gradient, the
    micro-batches with their weights over the ranks of ``group``, the step and a name for its
    error message; and its metrics come back under TRL's names."""
    import ppo_trainer.update as update

    calls: list[dict[str, Any]] = []

    def recording_step(model: Any, optimizer: Any, value_and_grad: Any, micro: Any,
                       weights: Any, **kwargs: Any) -> dict[str, mx.array]:  # fmt: skip
        calls.append(dict(model=model, optimizer=optimizer, value_and_grad=value_and_grad,
                          micro=micro, weights=[float(w) for w in weights], **kwargs))  # fmt: skip
        return {"loss": mx.array(float(len(calls))), "clipfrac": mx.array(0.5),
                "clip_ratio/low_mean": mx.array(0.25)}  # fmt: skip

    monkeypatch.setattr(update, "optimizer_step", recording_step)
    monkeypatch.setattr(mx.distributed, "all_sum", lambda x, group=None, stream=None: x + 1.0)
    group = TwoRanks()

    def token() -> Any:
        return cast(Any, object())  # stands for a model, optimiser or gradient: never called

    learners = [
        Learner(token(), token(), token(), "policy", "bnpo"),
        Learner(token(), token(), token(), "val", "grpo"),
    ]
    metrics = ppo_epochs(
        batch(False),
        learners,
        num_ppo_epochs=1,
        num_mini_batches=1,
        gradient_accumulation_steps=2,
        max_grad_norm=0.5,
        rng=np.random.default_rng(0),
        step=7,
        group=group,
    )
    assert len(calls) == 2
    for call, learner, what in zip(calls, learners, ["the policy loss", "the value loss"]):
        assert call["model"] is learner.model and call["optimizer"] is learner.optimizer
        assert call["value_and_grad"] is learner.value_and_grad
        assert call["step"] == 7 and call["what"] == what and call["group"] is group
        assert call["max_grad_norm"] == 0.5
        assert [len(mb) for mb in call["micro"]] == [2, 2]
    # bnpo over two ranks: R c_k / (c_k + 1) / n for this rank's token counts c_k
    tokens = [float(np.array(mb.mask).sum()) for mb in calls[0]["micro"]]
    assert calls[0]["weights"] == pytest.approx([2 * c / (c + 1) / 2 for c in tokens])
    assert calls[1]["weights"] == [0.5, 0.5]
    assert len(metrics) == 1
    assert {key: float(value) for key, value in metrics[0].items()} == {
        "loss/policy": 1.0,
        "policy/clipfrac": 0.5,
        "clip_ratio/low_mean": 0.25,
        "loss/value": 2.0,
        "val/clipfrac": 0.5,
    }


def test_the_value_loss_needs_values_and_returns() -> None:
    model = ValueTable(VALUE_WEIGHT)
    for missing in ("values", "returns"):
        mb = batch(False)
        setattr(mb, missing, None)
        with pytest.raises(AssertionError):
            value_loss_fn(config("ppo"))(model, mb)
