"""Masked statistics and whitening over the action tokens of a batch.

Statistics use valid entries only (``mask != 0``); whatever sits at invalid positions (pad logits,
garbage values, even NaN or inf) never reaches a result.

``validate=True`` (the default) counts the valid entries on the host and raises when there are too
few: one host sync, fine once per rollout. Functions that run inside a differentiated or compiled
step (the losses) pass ``validate=False``; the reward stage has already rejected empty rows, and a
mask with no valid entry then gives NaN rather than a silent 0.

``group`` (data-parallel training): each rank holds a slice of the batch, and the statistics are
those of the global batch: sums and counts are all-reduced over the ranks of the
``mx.distributed`` group (mean first, then the sum of squared deviations from it, the same two-pass
formula as on one process). Every rank of the group must call the function at the same point.
None, or a group of one, computes over the local array only.
"""

from __future__ import annotations

import mlx.core as mx

from base_setup.distributed import Group, all_sum
from token_attribution.extractor import check_same_shape, valid_mask

# Added to the variance before the inverse square root (TRL, OpenRLHF).
WHITEN_EPS = 1e-8


def _over_ranks(local_sum: mx.array, group: Group | None) -> mx.array:
    """A sum over this rank's entries -> the sum over every rank's (unchanged without a group)."""
    return local_sum if group is None else all_sum(local_sum, group)


def _require_count(count: mx.array, minimum: int, what: str) -> None:
    if not bool(mx.all(count >= minimum).item()):
        smallest = mx.min(count).astype(mx.int32).item()
        raise ValueError(
            f"{what} needs at least {minimum} valid (mask != 0) entries, but the mask has "
            f"{smallest}{' in some slice' if count.ndim else ''}; pass a mask with more action tokens"
        )


def masked_mean(
    x: mx.array,
    mask: mx.array,
    axis: int | tuple[int, ...] | None = None,
    *,
    validate: bool = True,
    group: Group | None = None,
) -> mx.array:
    """Mean of ``x`` over the valid entries: ``sum(x * m, axis) / sum(m, axis)``, ``m = mask != 0``.

    Args:
        x: array of any shape (e.g. (B, T)); cast to float32.
        mask: same shape as ``x``; bool, int or float, nonzero on valid entries.
        axis: axis or axes to reduce; None reduces everything to a scalar.
        validate: raise (after one host sync) if any reduced slice has no valid entry. Pass False
            inside compiled/differentiated code; an empty slice then gives NaN.
        group: sum over the ranks of this ``mx.distributed`` group too (global mean of a batch
            split across ranks; see the module docstring). None: local only.

    Returns:
        float32 array of ``x``'s shape without ``axis`` (a scalar for ``axis=None``).
    """
    check_same_shape("mask", mask, "x", x)
    valid = valid_mask(mask)
    count = _over_ranks(mx.sum(valid.astype(mx.float32), axis=axis), group)
    if validate:
        _require_count(count, 1, "masked_mean")
    # where() rather than x * mask so that NaN/inf at invalid positions cannot leak in.
    total = _over_ranks(mx.sum(mx.where(valid, x.astype(mx.float32), 0.0), axis=axis), group)
    return total / count


def masked_var(
    x: mx.array,
    mask: mx.array,
    unbiased: bool = True,
    *,
    validate: bool = True,
    group: Group | None = None,
) -> mx.array:
    """Variance of the valid entries of ``x`` (all of them, a scalar).

    ``var = sum(m (x - mean)^2) / n``, times ``n / (n - 1)`` (Bessel) when ``unbiased``,
    with ``n = sum(m)`` and ``mean = masked_mean(x, mask)``.

    Args:
        x: array of any shape; cast to float32.
        mask: same shape as ``x``, nonzero on valid entries.
        unbiased: apply Bessel's correction (needs n >= 2).
        validate: raise (one host sync) when n < 2 (unbiased) or n < 1.
        group: statistics of the batch split across the ranks of this ``mx.distributed`` group
            (n, mean and the squared deviations summed over all ranks). None: local only.

    Returns:
        float32 scalar.
    """
    check_same_shape("mask", mask, "x", x)
    valid = valid_mask(mask)
    count = _over_ranks(mx.sum(valid.astype(mx.float32)), group)
    if validate:
        _require_count(
            count, 2 if unbiased else 1, "unbiased masked_var" if unbiased else "masked_var"
        )
    mean = masked_mean(x, valid, validate=False, group=group)
    centred = mx.where(valid, x.astype(mx.float32) - mean, 0.0)
    var = _over_ranks(mx.sum(centred * centred), group) / count
    if unbiased:
        var = var * count / (count - 1.0)
    return var


def masked_whiten(
    x: mx.array,
    mask: mx.array,
    shift_mean: bool = True,
    *,
    validate: bool = True,
    group: Group | None = None,
) -> mx.array:
    """Whiten the valid entries of ``x`` with their own mean and (unbiased) variance.

    ``y = (x - mean) * rsqrt(var + 1e-8)``; ``y += mean`` when ``not shift_mean`` (keeps the mean, only
    rescales: TRL/OpenRLHF use this for rewards). Invalid entries of ``y`` are 0.

    Args:
        x: array of any shape, e.g. (B, T) advantages; cast to float32.
        mask: same shape as ``x``, nonzero on valid entries (needs at least 2 of them).
        shift_mean: subtract the mean (True) or keep it (False).
        validate: raise (one host sync) when fewer than 2 entries are valid.
        group: whiten with the mean and variance of the whole batch split across the ranks of
            this ``mx.distributed`` group; each rank gets its own rows back. None: local only.

    Returns:
        float32 array of ``x``'s shape. All statistics are part of the graph (no stop_gradient).
    """
    check_same_shape("mask", mask, "x", x)
    valid = valid_mask(mask)
    x = x.astype(mx.float32)
    mean = masked_mean(x, valid, validate=False, group=group)
    var = masked_var(x, valid, unbiased=True, validate=validate, group=group)
    whitened = (x - mean) * mx.rsqrt(var + WHITEN_EPS)
    if not shift_mean:
        whitened = whitened + mean
    return mx.where(valid, whitened, 0.0)
