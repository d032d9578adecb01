"""Critic-free advantages from several samples per prompt: GRPO (group-normalised) and RLOO.

Scores are laid out group by group: rows ``[k*g : (k+1)*g]`` are the ``g`` samples of prompt ``k``.
"""

from __future__ import annotations

from typing import Literal

import mlx.core as mx

from advantage.whitening import masked_var
from base_setup.distributed import Group
from reward_kl.reward_computer import sequence_rewards
from token_attribution.extractor import check_ndim

# Added to the standard deviation (TRL's GRPOTrainer).
GROUP_STD_EPS = 1e-4


def _grouped(scores: mx.array, group_size: int) -> mx.array:
    check_ndim("scores", scores, 1, "(B,)")
    if group_size < 2:
        raise ValueError(f"group_size must be >= 2 (samples per prompt), got {group_size}")
    if scores.shape[0] % group_size != 0:
        raise ValueError(
            f"scores has {scores.shape[0]} entries, not a multiple of group_size={group_size}; "
            f"generate group_size samples for every prompt"
        )
    return scores.astype(mx.float32).reshape(-1, group_size)  # (P, g), P prompts


def group_advantages(
    scores: mx.array,
    group_size: int,
    scale: Literal["group", "batch", "none"] = "group",
    *,
    group: Group | None = None,
) -> mx.array:
    """Group-relative advantages (GRPO, Shao et al. 2024).

    ``A_i = (r_i - mean_group(r))``, divided by

    * ``"group"``: ``std_group(r) + 1e-4`` (std of the sample's own group, Bessel-corrected);
    * ``"batch"``: ``std(r) + 1e-4`` over all B scores (Bessel-corrected; TRL's ``scale_rewards="batch"``);
    * ``"none"``: nothing (mean-centred only, Dr. GRPO).

    Args:
        scores: (B,) sequence scores (constants), B = P * group_size, group by group.
        group_size: g, samples per prompt (>= 2).
        scale: which standard deviation divides the centred scores.
        group: data-parallel ranks (``mx.distributed`` group) holding the other slices of the
            batch, whole prompt groups each: ``"batch"`` then uses the std of the global batch
            (all-reduced). ``"group"`` and ``"none"`` need nothing from the other ranks. None:
            the local batch is the whole batch.

    Returns:
        (B,) float32 advantages.
    """
    grouped = _grouped(scores, group_size)  # (P, g)
    centred = grouped - mx.mean(grouped, axis=1, keepdims=True)  # (P, g)
    if scale == "group":
        std = mx.sqrt(mx.sum(centred * centred, axis=1, keepdims=True) / (group_size - 1))  # (P, 1)
        centred = centred / (std + GROUP_STD_EPS)
    elif scale == "batch" and group is not None and group.size() > 1:
        flat = grouped.reshape(-1)  # (B,)
        std = mx.sqrt(masked_var(flat, mx.ones_like(flat), validate=False, group=group))  # ()
        centred = centred / (std + GROUP_STD_EPS)
    elif scale == "batch":
        flat = grouped.reshape(-1)  # (B,)
        deviation = flat - mx.mean(flat)
        std = mx.sqrt(mx.sum(deviation * deviation) / (flat.shape[0] - 1))  # ()
        centred = centred / (std + GROUP_STD_EPS)
    elif scale != "none":
        raise ValueError(f"scale must be 'group', 'batch' or 'none', got {scale!r}")
    return centred.reshape(-1)  # (B,)


def leave_one_out_advantages(scores: mx.array, group_size: int) -> mx.array:
    """RLOO advantages (Ahmadian et al. 2024): each score minus the mean of the others in its group.

    ``A_i = r_i - (sum_group(r) - r_i) / (g - 1)``.

    Args:
        scores: (B,) sequence scores (constants), B = P * group_size, group by group.
        group_size: g, samples per prompt (>= 2).

    Returns:
        (B,) float32 advantages.
    """
    grouped = _grouped(scores, group_size)  # (P, g)
    others_mean = (mx.sum(grouped, axis=1, keepdims=True) - grouped) / (group_size - 1)  # (P, g)
    return (grouped - others_mean).reshape(-1)  # (B,)


def rloo_advantages(
    scores: mx.array, kl: mx.array, mask: mx.array, kl_coef: float | mx.array, group_size: int
) -> tuple[mx.array, mx.array]:
    """RLOO as TRL's RLOOTrainer: the KL penalty in the sequence reward, then the leave-one-out
    baseline.

    ``R_b = score_b - kl_coef * sum_t m_bt kl_bt``
    (:func:`reward_kl.reward_computer.sequence_rewards`), ``A_b = R_b - mean_{j != b in the group}
    R_j`` (:func:`leave_one_out_advantages`). The advantages are not normalised (TRL's
    ``normalize_advantages=False`` default); the baseline needs only the prompt's own group, so
    each rank of a data-parallel run computes its rows alone.

    Args:
        scores: (B,) sequence scores (constants), B = P * group_size, group by group.
        kl: (B, T) per-token KL estimates of the rollout policy against the reference
            (constants; TRL uses ``"k1"``).
        mask: (B, T), nonzero on action tokens.
        kl_coef: the KL coefficient (TRL's RLOO ``beta``).
        group_size: g, samples per prompt (>= 2).

    Returns:
        ``(advantages, rewards)``: (B,) float32 each; ``rewards`` are the ``R_b`` (TRL logs their
        mean as the RLHF reward).
    """
    rewards = sequence_rewards(scores, kl, mask, kl_coef)  # (B,)
    return leave_one_out_advantages(rewards, group_size), rewards
