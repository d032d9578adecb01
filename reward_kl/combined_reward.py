"""Several reward functions or models, weighted into one score per sequence (TRL's GRPOTrainer
``reward_funcs`` + ``reward_weights``).

``K`` reward functions score the same ``B`` completions; a function may return ``None`` for a
completion it does not apply to (a math checker on a completion with no answer), which is stored
as NaN and left out of that completion's weighted sum (TRL's ``nansum``). A completion that no
function scores has no reward at all: TRL marks it NaN and zeroes its advantage; here it is an
error naming the completions, so that a silent 0 never trains the policy.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import mlx.core as mx
import numpy as np

from token_attribution.extractor import check_ndim

#: The largest float32: a score beyond it is stored as inf.
FLOAT32_MAX = float(np.finfo(np.float32).max)


def score_value(score: float | int) -> float:
    """``score`` as a float, with a Python int beyond float's range (``10**400``, which
    ``float()`` refuses with ``OverflowError``) as ``inf`` of its sign; a score is kept as
    float32, so callers count ``|x| > FLOAT32_MAX`` as non-finite too (:func:`finite_score`)."""
    try:
        return float(score)
    except OverflowError:
        return math.inf if score > 0 else -math.inf


def finite_score(value: float) -> bool:
    """Whether a score's float stays finite in float32 (NaN, inf and ``|x| > 3.4e38`` do not)."""
    return math.isfinite(value) and abs(value) <= FLOAT32_MAX


def reward_matrix(
    values: Sequence[Sequence[float | None]], names: Sequence[str], num_completions: int
) -> mx.array:
    """The ``(K, B)`` score array from each reward function's list of scores.

    ``None`` (not applicable) becomes NaN; a NaN or infinite score returned by a function is
    refused, since NaN is reserved for "not applicable", as is one beyond float32's range
    (an int beyond float's included, :func:`score_value`).

    Args:
        values: K lists of B scores (float or None), in the order of ``names``.
        names: the K reward functions' names (for the error messages).
        num_completions: B.

    Returns:
        (K, B) float32.

    Raises:
        ValueError: a list of the wrong length, or a score that is NaN or infinite (named by
            function and completion index).
    """
    if len(values) != len(names):
        raise ValueError(f"got scores from {len(values)} reward functions for {len(names)} names")
    out = np.full((len(values), num_completions), np.nan, dtype=np.float32)
    for k, (name, scores) in enumerate(zip(names, values)):
        if len(scores) != num_completions:
            raise ValueError(
                f"reward function {name!r} returned {len(scores)} scores for {num_completions} "
                f"completions; return one score (or None) per completion"
            )
        for b, score in enumerate(scores):
            if score is None:
                continue
            value = score_value(score)
            if not finite_score(value):
                raise ValueError(
                    f"reward function {name!r} returned {score!r:.40} for completion {b} (NaN, inf, "
                    "or beyond float32's 3.4e38); return a finite number, or None where the "
                    "function does not apply"
                )
            out[k, b] = value
    return mx.array(out)


def combine_rewards(rewards_per_func: mx.array, weights: Sequence[float] | mx.array) -> mx.array:
    """The weighted sum of the reward functions' scores, skipping the not-applicable (NaN) ones.

    ``R_b = sum_{k : r_kb not NaN} w_k r_kb`` (TRL: ``(rewards_per_func * weights).nansum``).
    With one function and weight 1 this is that function's score, unchanged.

    Args:
        rewards_per_func: (K, B) scores, NaN where function ``k`` does not apply to completion
            ``b`` (:func:`reward_matrix`).
        weights: (K,) finite weights (TRL's ``reward_weights``; all 1 when not given).

    Returns:
        (B,) float32.

    Raises:
        ValueError: a completion that no function scored (one host sync), or weights of the wrong
            length.
    """
    check_ndim("rewards_per_func", rewards_per_func, 2, "(K, B)")
    w = weights if isinstance(weights, mx.array) else mx.array(list(weights), dtype=mx.float32)
    if tuple(w.shape) != (rewards_per_func.shape[0],):
        raise ValueError(
            f"weights has shape {tuple(w.shape)} but there are {rewards_per_func.shape[0]} "
            f"reward functions; pass one weight per function"
        )
    scores = rewards_per_func.astype(mx.float32)
    applicable = mx.logical_not(mx.isnan(scores))  # (K, B)
    unscored = np.flatnonzero(~np.array(mx.any(applicable, axis=0))).tolist()
    if unscored:
        raise ValueError(
            f"completions {unscored} were scored by no reward function (every one returned "
            f"None); make at least one function score every completion, e.g. a format reward"
        )
    weighted = mx.where(applicable, w.astype(mx.float32)[:, None] * scores, 0.0)  # (K, B)
    return mx.sum(weighted, axis=0)  # (B,)


def reward_metrics(rewards_per_func: mx.array, names: Sequence[str]) -> dict[str, mx.array]:
    """TRL's per-function metrics: ``rewards/<name>/mean`` and ``rewards/<name>/std`` over the
    completions the function applies to (NaN-aware; std Bessel-corrected, as TRL's ``nanstd``).

    A statistic that is undefined is left out rather than logged as NaN: the mean of a function
    that applied to no completion, the std of one that applied to fewer than 2.

    Args:
        rewards_per_func: (K, B) scores, NaN where not applicable.
        names: the K names.

    Returns:
        Scalar float32 arrays by metric name.
    """
    check_ndim("rewards_per_func", rewards_per_func, 2, "(K, B)")
    if len(names) != rewards_per_func.shape[0]:
        raise ValueError(f"got {len(names)} names for {rewards_per_func.shape[0]} reward functions")
    scores = rewards_per_func.astype(mx.float32)
    applicable = mx.logical_not(mx.isnan(scores))  # (K, B)
    counts = mx.sum(applicable.astype(mx.float32), axis=1)  # (K,)
    means = mx.sum(mx.where(applicable, scores, 0.0), axis=1) / mx.maximum(counts, 1.0)  # (K,)
    deviations = mx.where(applicable, scores - means[:, None], 0.0)  # (K, B)
    stds = mx.sqrt(mx.sum(deviations * deviations, axis=1) / mx.maximum(counts - 1.0, 1.0))
    n = np.array(counts).astype(int).tolist()  # one host sync: which statistics exist
    metrics: dict[str, mx.array] = {}
    for k, name in enumerate(names):
        if n[k] >= 1:
            metrics[f"rewards/{name}/mean"] = means[k]
        if n[k] >= 2:
            metrics[f"rewards/{name}/std"] = stds[k]
    return metrics
