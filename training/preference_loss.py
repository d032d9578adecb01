"""Preference-optimisation losses: DPO and its family, as TRL's DPOTrainer, CPOTrainer (SimPO) and
ORPOTrainer define them.

Each loss is a pure function of per-sequence log-probabilities, shape ``(B,)`` for ``B`` pairs:
``policy_chosen`` / ``policy_rejected`` are ``log pi(y | x)`` of the chosen and rejected answers
(summed over their tokens, or averaged per token where the loss says so), ``ref_chosen`` /
``ref_rejected`` the same under the frozen reference, constants (computed before training; no
gradient flows into them). :func:`preference_loss` picks one by TRL's ``loss_type`` name from
summed log-probs and answer lengths (it averages where TRL does: ipo's log-ratios, simpo's and
orpo's log-probs), and adds TRL's metrics.
"""

from __future__ import annotations

import math

import mlx.core as mx
import mlx.nn as nn

from config.dpo_config import PreferenceLossType


def answer_logps(token_logps: mx.array, answer_mask: mx.array) -> mx.array:
    """Log-prob of each sequence's answer: ``sum_t mask[b,t] logp[b,t]``, shape (N,), from
    (N, T) per-token log-probs and the (N, T) answer mask (1 at the answer's tokens, 0 at the
    prompt and padding)."""
    return (token_logps * answer_mask).sum(axis=-1)


def dpo_logits(
    policy_chosen: mx.array,
    policy_rejected: mx.array,
    ref_chosen: mx.array,
    ref_rejected: mx.array,
) -> mx.array:
    """``h = (log pi(y_w) - log pi(y_l)) - (log pi_ref(y_w) - log pi_ref(y_l))``, shape (B,):
    the policy's log-ratio of chosen over rejected, relative to the reference's (TRL's
    ``logits``)."""
    return (policy_chosen - policy_rejected) - (ref_chosen - ref_rejected)


def sigmoid_loss(logits: mx.array, beta: float, label_smoothing: float = 0.0) -> mx.array:
    """DPO (Rafailov et al. 2023, eq. 7), with cDPO's label smoothing eps:

    ``loss = -(1 - eps) log sigmoid(beta h) - eps log sigmoid(-beta h)``, shape (B,)

    for ``h`` = :func:`dpo_logits`: the negative log-likelihood of the preference under the
    Bradley-Terry model of the implicit reward ``beta log(pi / pi_ref)``, with each label
    flipped with probability eps.
    """
    return (
        -nn.log_sigmoid(beta * logits) * (1.0 - label_smoothing)
        - nn.log_sigmoid(-beta * logits) * label_smoothing
    )


def robust_loss(logits: mx.array, beta: float, label_smoothing: float = 0.0) -> mx.array:
    """Robust DPO (Chowdhury et al. 2024, eq. 7), unbiased under label noise rate eps < 1/2:

    ``loss = (-(1 - eps) log sigmoid(beta h) + eps log sigmoid(-beta h)) / (1 - 2 eps)``, (B,)

    (TRL's ``robust``: note the + before eps, unlike cDPO's :func:`sigmoid_loss`).
    """
    return (
        -nn.log_sigmoid(beta * logits) * (1.0 - label_smoothing)
        + nn.log_sigmoid(-beta * logits) * label_smoothing
    ) / (1.0 - 2.0 * label_smoothing)


def hinge_loss(logits: mx.array, beta: float) -> mx.array:
    """SLiC's hinge loss (Zhao et al. 2023) on the DPO logits: ``loss = relu(1 - beta h)``, (B,)."""
    return nn.relu(1.0 - beta * logits)


def ipo_loss(logits: mx.array, beta: float) -> mx.array:
    """IPO (Azar et al. 2023, eq. 17) with tau = beta: ``loss = (h - 1 / (2 beta))^2``, (B,).

    TRL (and :func:`preference_loss`) pass ``h`` from per-token *averaged* log-ratios.
    """
    return (logits - 1.0 / (2.0 * beta)) ** 2


def simpo_loss(
    policy_chosen: mx.array,
    policy_rejected: mx.array,
    beta: float,
    gamma: float,
    label_smoothing: float = 0.0,
) -> mx.array:
    """SimPO (Meng et al. 2024, eq. 6), reference-free, on per-token averaged log-probs:

    ``u = beta (avg log pi(y_w) - avg log pi(y_l)) - gamma``
    ``loss = -(1 - eps) log sigmoid(u) - eps log sigmoid(-u)``, shape (B,)

    (TRL's CPOTrainer with ``loss_type="simpo"``, which writes ``u = beta (h - gamma / beta)``).
    """
    u = beta * (policy_chosen - policy_rejected) - gamma
    return -nn.log_sigmoid(u) * (1.0 - label_smoothing) - nn.log_sigmoid(-u) * label_smoothing


def log1mexp(x: mx.array) -> mx.array:
    """``log(1 - exp(x))`` for ``x < 0``, accurate at both ends (Maechler 2012):
    ``log(-expm1(x))`` above ``-log 2``, ``log1p(-exp(x))`` below (TRL's ``log1mexp``)."""
    near_zero = x > -math.log(2.0)
    return mx.where(near_zero, mx.log(-mx.expm1(x)), mx.log1p(-mx.exp(x)))


def orpo_log_odds_ratio(policy_chosen: mx.array, policy_rejected: mx.array) -> mx.array:
    """ORPO's log odds ratio term (Hong et al. 2024, eq. 4-7) on per-token averaged log-probs
    ``a`` (B,):

    ``log odds(y) = a - log(1 - exp(a))``;
    returns ``log sigmoid(log odds(y_w) - log odds(y_l))``, shape (B,) (TRL's ``ratio``). The ORPO
    loss is ``NLL(y_w) - beta * mean_b(this)``.
    """
    log_odds = (policy_chosen - policy_rejected) - (
        log1mexp(policy_chosen) - log1mexp(policy_rejected)
    )  # (B,)
    return nn.log_sigmoid(log_odds)


def preference_loss(
    loss_type: PreferenceLossType,
    policy_chosen: mx.array,
    policy_rejected: mx.array,
    ref_chosen: mx.array | None,
    ref_rejected: mx.array | None,
    chosen_lengths: mx.array,
    rejected_lengths: mx.array,
    *,
    beta: float,
    label_smoothing: float = 0.0,
    simpo_gamma: float = 0.5,
    chosen_nll: mx.array | None = None,
) -> tuple[mx.array, dict[str, mx.array]]:
    """The mean ``loss_type`` loss over B pairs, and TRL's metrics, as TRL computes them.

    Args:
        loss_type: "sigmoid", "robust", "hinge", "ipo" (need the reference's log-probs),
            "simpo" or "orpo" (reference-free).
        policy_chosen, policy_rejected: (B,) the policy's log-probs of each pair's answers,
            summed over the answer's tokens.
        ref_chosen, ref_rejected: (B,) the reference's, summed likewise; constants. None for
            simpo and orpo.
        chosen_lengths, rejected_lengths: (B,) tokens of each answer: ipo divides the log-ratios
            by them (TRL's DPOTrainer), simpo and orpo the log-probs (TRL's CPO / ORPO trainers).
        beta, label_smoothing, simpo_gamma: as in :class:`config.dpo_config.DPOConfig`.
        chosen_nll: scalar mean negative log-likelihood per token of the chosen answers (orpo).

    Returns:
        ``(loss, metrics)``: ``rewards/chosen`` and ``rewards/rejected`` (mean implicit rewards:
        ``beta (log pi - log pi_ref)`` with summed log-probs, or ``beta avg log pi`` for simpo
        and orpo), ``rewards/accuracies`` (fraction of pairs whose chosen reward is the larger;
        ties count as wrong), ``rewards/margins``, ``logps/chosen``, ``logps/rejected`` (the
        log-probs the rewards use); orpo adds ``nll_loss`` and ``log_odds_ratio``.

    Raises:
        ValueError: an unknown loss_type, or a missing input it needs.
    """
    extra: dict[str, mx.array] = {}
    if loss_type in ("simpo", "orpo"):
        policy_chosen = policy_chosen / mx.maximum(chosen_lengths, 1.0)  # (B,) averages
        policy_rejected = policy_rejected / mx.maximum(rejected_lengths, 1.0)
        chosen_rewards = beta * policy_chosen
        rejected_rewards = beta * policy_rejected
        if loss_type == "simpo":
            losses = simpo_loss(policy_chosen, policy_rejected, beta, simpo_gamma, label_smoothing)
            loss = losses.mean()
        else:
            if chosen_nll is None:
                raise ValueError("loss_type='orpo' needs chosen_nll, the NLL of the chosen answers")
            ratio = orpo_log_odds_ratio(policy_chosen, policy_rejected)  # (B,)
            loss = chosen_nll - beta * ratio.mean()
            extra = {"nll_loss": chosen_nll, "log_odds_ratio": ratio.mean()}
    else:
        if ref_chosen is None or ref_rejected is None:
            raise ValueError(f"loss_type={loss_type!r} needs the reference's log-probs")
        chosen_logratios = policy_chosen - ref_chosen  # (B,)
        rejected_logratios = policy_rejected - ref_rejected  # (B,)
        chosen_rewards = beta * chosen_logratios
        rejected_rewards = beta * rejected_logratios
        logits = dpo_logits(policy_chosen, policy_rejected, ref_chosen, ref_rejected)  # (B,)
        if loss_type == "sigmoid":
            losses = sigmoid_loss(logits, beta, label_smoothing)
        elif loss_type == "robust":
            losses = robust_loss(logits, beta, label_smoothing)
        elif loss_type == "hinge":
            losses = hinge_loss(logits, beta)
        elif loss_type == "ipo":
            # IPO on per-token averaged log-ratios, as TRL (confirmed with the IPO authors).
            avg_logits = chosen_logratios / mx.maximum(
                chosen_lengths, 1.0
            ) - rejected_logratios / mx.maximum(rejected_lengths, 1.0)
            losses = ipo_loss(avg_logits, beta)
        else:
            raise ValueError(
                f"unknown loss_type {loss_type!r}: use sigmoid, ipo, hinge, robust, simpo or orpo"
            )
        loss = losses.mean()
    # The metrics are reported, not optimised: no gradient through them.
    chosen_rewards = mx.stop_gradient(chosen_rewards)
    rejected_rewards = mx.stop_gradient(rejected_rewards)
    metrics = {
        "rewards/chosen": chosen_rewards.mean(),
        "rewards/rejected": rejected_rewards.mean(),
        "rewards/accuracies": (chosen_rewards > rejected_rewards).astype(mx.float32).mean(),
        "rewards/margins": (chosen_rewards - rejected_rewards).mean(),
        "logps/chosen": mx.stop_gradient(policy_chosen).mean(),
        "logps/rejected": mx.stop_gradient(policy_rejected).mean(),
        **{k: mx.stop_gradient(v) for k, v in extra.items()},
    }
    return loss, metrics
