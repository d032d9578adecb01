"""Which response tokens are actions: cut each response after its first stop token.

The generator returns a (B, T) block of response tokens; a row keeps generating pad after it emits a
stop token (EOS, or any other id the task treats as the end). The tokens the policy chose, up to and
including the first stop token, are the actions; everything else is masked out of the RL math.

Also here: the two small helpers every stage uses to read a mask and check shapes, so that all of
them accept the same masks (bool, int or float, 1 on action tokens) and word shape errors alike.
"""

from __future__ import annotations

from collections.abc import Sequence

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


def _stop_ids(stop_token_ids: int | Sequence[int]) -> list[int]:
    ids = [stop_token_ids] if isinstance(stop_token_ids, int) else list(stop_token_ids)
    if not ids:
        raise ValueError(
            "stop_token_ids is empty; pass at least one stop token id (e.g. the EOS id)"
        )
    for i in ids:
        if not isinstance(i, int) or isinstance(i, bool):
            raise ValueError(f"stop_token_ids must be Python ints, got {i!r} ({type(i).__name__})")
    return ids


def _is_stop(responses: mx.array, ids: list[int]) -> mx.array:
    is_stop = responses == ids[0]  # (B, T) bool
    for i in ids[1:]:
        is_stop = mx.logical_or(is_stop, responses == i)
    return is_stop


def first_stop_index(
    responses: mx.array, stop_token_ids: int | Sequence[int]
) -> tuple[mx.array, mx.array]:
    """Position of the first stop token in each row, and whether there is one.

    Args:
        responses: (B, T) integer token ids.
        stop_token_ids: one id or several (any of them ends a response).

    Returns:
        ``(stop_index, ended_with_stop)``: (B,) int32 index of the first stop token (``T`` where the
        row has none) and (B,) bool, True where the row contains a stop token. Calling this on the
        output of :func:`truncate_after_stop` gives the same answer as on its input.
    """
    check_ndim("responses", responses, 2, "(B, T)")
    is_stop = _is_stop(responses, _stop_ids(stop_token_ids))  # (B, T)
    # Positions strictly before the first stop have cumsum 0; counting them gives its index.
    before_stop = mx.cumsum(is_stop.astype(mx.int32), axis=1) == 0  # (B, T)
    stop_index = mx.sum(before_stop.astype(mx.int32), axis=1).astype(mx.int32)  # (B,)
    ended_with_stop = mx.any(is_stop, axis=1)  # (B,)
    return stop_index, ended_with_stop


def truncate_after_stop(
    responses: mx.array, stop_token_ids: int | Sequence[int], pad_token_id: int
) -> tuple[mx.array, mx.array, mx.array]:
    """Cut each response after its first stop token and mark the action tokens.

    Rule (per row ``b``, positions ``t`` in ``0..T-1``):

    * The row contains a stop token, first at ``s``: ``mask[b, t] = t <= s`` (the stop token is an
      action: the policy chose to stop), and every token after ``s`` becomes ``pad_token_id``.
    * The row contains no stop token (it ran out of budget): every token is kept, except that when
      ``pad_token_id`` differs from every stop id, the trailing run of ``pad_token_id`` (batched
      generation pads finished rows) is not an action. Pad tokens *inside* the content stay valid.
      When ``pad_token_id`` is itself a stop id (e.g. pad == EOS), the first pad is a stop token by the
      rule above, so a row with no stop token has no pad and is valid to its end.

    Args:
        responses: (B, T) integer token ids from the generator.
        stop_token_ids: one id or several; the first occurrence of any of them ends the response.
        pad_token_id: id written after the stop token.

    Returns:
        ``(responses, mask, lengths)``: (B, T) ids (same dtype) with ``pad_token_id`` after the stop
        token; (B, T) float32 mask, 1.0 on action tokens; (B,) int32 number of action tokens
        (0 for a row that is all trailing pad - the reward stage rejects such rows). Use
        :func:`first_stop_index` for the (B,) bool ``ended_with_stop``.
    """
    check_ndim("responses", responses, 2, "(B, T)")
    if not isinstance(pad_token_id, int) or isinstance(pad_token_id, bool):
        raise ValueError(f"pad_token_id must be a Python int, got {pad_token_id!r}")
    ids = _stop_ids(stop_token_ids)
    T = responses.shape[1]
    stop_index, ended_with_stop = first_stop_index(responses, ids)  # (B,), (B,)
    positions = mx.arange(T, dtype=mx.int32)[None, :]  # (1, T)
    # Rows without a stop have stop_index == T, so this keeps the whole row.
    mask = positions <= stop_index[:, None]  # (B, T) bool
    # Rows without a stop: drop the trailing pad run (no content token at or after t). When pad is a
    # stop id such a row contains no pad, so this changes nothing, as the rule says.
    content = (responses != pad_token_id).astype(mx.int32)  # (B, T)
    trailing_pad = mx.cumsum(content, axis=1, reverse=True) == 0  # (B, T)
    mask = mx.where(ended_with_stop[:, None], mask, mx.logical_not(trailing_pad))
    responses = mx.where(mask, responses, mx.array(pad_token_id, dtype=responses.dtype))
    lengths = mx.sum(mask.astype(mx.int32), axis=1).astype(mx.int32)  # (B,)
    return responses, mask.astype(mx.float32), lengths


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
        ended_with_stop: (B,) bool (or 0/1), from :func:`first_stop_index`.

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
