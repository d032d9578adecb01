"""Which response tokens are actions, and the shape checks every stage shares.

The rollout marks the actions (up to and including each response's first stop token, see
``ppo_trainer/rollout.py``); the helpers here read those masks (bool, int or float, 1 on action
tokens) and word shape errors alike, and :func:`mask_truncated_completions` drops the completions
that ran out of budget.
"""

from __future__ import annotations


import mlx.core as mx


def check_same_shape(name: str, array: mx.array, ref_name: str, ref: mx.array) -> None:
    """Raise ``ValueError`` unless ``array`` has the shape of ``ref``.

    The message names both arguments, e.g. ``"mask has shape (4, 7) but logprobs has (4, 8)"``.
    """
    if tuple(array.shape) != tuple(ref.shape):
        raise ValueError(
            f"{name} has shape {tuple(array.shape)} but {ref_name} has {tuple(ref.shape)}; "
            f"they must match"
        )


def check_ndim(name: str, array: mx.array, ndim: int, dims: str) -> None:
    """Raise ``ValueError`` unless ``array`` has ``ndim`` dimensions (``dims`` names them, e.g. "(B, T)")."""
    if array.ndim != ndim:
        raise ValueError(f"{name} must have shape {dims}, got {tuple(array.shape)}")


def check_token_arrays(ref_name: str, ref: mx.array, **others: mx.array) -> None:
    """Raise ``ValueError`` unless ``ref`` is (B, T) and every array in ``others`` has its shape."""
    check_ndim(ref_name, ref, 2, "(B, T)")
    for name, array in others.items():
        check_same_shape(name, array, ref_name, ref)


def valid_mask(mask: mx.array) -> mx.array:
    """Read an action mask of any dtype as bool: ``mask != 0`` (True on action tokens)."""
    if mask.dtype == mx.bool_:
        return mask
    return mask != 0


def mask_truncated_completions(mask: mx.array, ended_with_stop: mx.array) -> mx.array:
    """Drop truncated completions from a loss mask (DAPO's overlong filtering; TRL's
    ``mask_truncated_completions``).

    ``out[b, t] = mask[b, t]`` if response ``b`` ended with a stop token, else 0: a completion cut
    off by the token budget says nothing reliable about its ending, so none of its tokens is
    learned from. Apply it to the mask the policy loss sees; advantages are computed from every
    completion first (TRL computes its group statistics before masking, and its ``"dapo"``
    normaliser then counts only the unmasked tokens, as :func:`training.policy_loss.aggregate_loss`
    does with this mask).

    Args:
        mask: (B, T) action mask (bool, int or float).
        ended_with_stop: (B,) bool (or 0/1): whether each response ended with a stop token
            (the generator's ``ended_with_stop``).

    Returns:
        (B, T), ``mask``'s dtype.
    """
    check_ndim("mask", mask, 2, "(B, T)")
    if tuple(ended_with_stop.shape) != (mask.shape[0],):
        raise ValueError(
            f"ended_with_stop has shape {tuple(ended_with_stop.shape)} but mask has "
            f"{tuple(mask.shape)}; pass one flag per row, shape (B,)"
        )
    keep = valid_mask(ended_with_stop)[:, None]  # (B, 1)
    return mx.where(keep, mask, mx.zeros_like(mask))
