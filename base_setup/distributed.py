"""Data parallelism across processes with MLX's own ``mx.distributed`` (started by ``mlx.launch``).

``mlx.launch -n N python main.py train ...`` starts N copies of the same program; each is one rank
of the global group (:func:`world`). A program started without the launcher is a group of one,
and every helper here is then the identity or a no-op (no communication), so the single-process
code path is the data-parallel one with ``N = 1``.

What the helpers are for:

* reductions: :func:`all_sum`, :func:`all_mean`, :func:`any_rank`, :func:`average_gradients`;
* start-up agreement, run collectively by every rank before any work, so that a bad set-up raises
  the same error on every rank instead of leaving some ranks waiting forever in a collective:
  :func:`check_same_on_all_ranks` (configs, prompt lists, checkpoints), :func:`check_same_weights`
  (identical parameters), :func:`raise_if_any_rank_failed` (a step that can fail on some ranks).
  They fail through :func:`fail_together`: every rank logs the error before any rank raises, since
  ``mlx.launch`` kills the other ranks as soon as one exits.

Collectives run on the default stream of the default device, which the backend supports (ring and
MPI on CPU or Metal, NCCL on CUDA).
"""

from __future__ import annotations

import hashlib
import json
import logging
from typing import Any, Mapping, NoReturn, Sequence

import mlx.core as mx
import numpy as np
from mlx.nn.utils import average_gradients as _average_gradients
from mlx.utils import tree_flatten

Group = mx.distributed.Group

logger = logging.getLogger("ppo_mlx")


def world() -> Group:
    """The global group of the launched processes (a group of one without ``mlx.launch``).

    ``mx.distributed.init()`` picks the backend the launcher prepared (ring, MPI, NCCL, JACCL) and
    returns the same group on every later call.
    """
    return mx.distributed.init()


def world_size(group: Group | None = None) -> int:
    """Number of ranks in ``group`` (default: :func:`world`)."""
    return (group or world()).size()


def rank(group: Group | None = None) -> int:
    """This process's rank in ``group`` (default: :func:`world`), 0 .. size - 1."""
    return (group or world()).rank()


def is_main_process(group: Group | None = None) -> bool:
    """Whether this is rank 0, the one rank that writes logs, plots and checkpoints."""
    return rank(group) == 0


def all_sum(x: mx.array, group: Group | None = None) -> mx.array:
    """``sum_r x_r`` over the ranks (same shape as ``x``; ``x`` itself on a group of one)."""
    group = group or world()
    if group.size() == 1:
        return x
    return mx.distributed.all_sum(x, group=group)


def all_mean(x: mx.array, group: Group | None = None) -> mx.array:
    """``sum_r x_r / N`` over the N ranks (``x`` itself on a group of one)."""
    group = group or world()
    if group.size() == 1:
        return x
    return mx.distributed.all_sum(x, group=group) / group.size()


def any_rank(flag: bool, group: Group | None = None) -> bool:
    """True on every rank when ``flag`` is True on at least one (one host sync)."""
    group = group or world()
    if group.size() == 1:
        return flag
    return bool(mx.distributed.all_sum(mx.array(int(flag), dtype=mx.int32), group=group).item())


def average_gradients(grads: Any, group: Group | None = None) -> Any:
    """``sum_r g_r / N`` for every array of a gradient tree (mlx's ``average_gradients``: the
    arrays are packed into a few large all-reduces). Returns ``grads`` on a group of one."""
    group = group or world()
    if group.size() == 1:
        return grads
    return _average_gradients(grads, group)


def barrier(group: Group | None = None) -> None:
    """Wait until every rank of ``group`` reaches this point (no-op on a group of one)."""
    group = group or world()
    if group.size() > 1:
        mx.eval(mx.distributed.all_sum(mx.array(0, dtype=mx.int32), group=group))


def fail_together(error: BaseException, group: Group | None = None) -> NoReturn:
    """Log ``error`` on this rank, wait for every rank, then raise it.

    For failures that every rank detects at the same point (a collective decision): each rank's
    message is out before any rank exits and the launcher stops the rest. Never call it from a
    failure only some ranks see: the others would not reach the barrier.
    """
    group = group or world()
    if group.size() > 1:
        logger.error("rank %d of %d stops: %s", group.rank(), group.size(), error)
        barrier(group)
    raise error


def _gather_rows(row: np.ndarray, group: Group) -> np.ndarray:
    """Every rank's ``row`` (1-D, same length and dtype everywhere) as an (N, len) array."""
    gathered = mx.distributed.all_gather(mx.array(row)[None], group=group)  # (N, len)
    return np.array(gathered)


def _rank_list(ranks: Sequence[int]) -> str:
    return ", ".join(str(r) for r in ranks)


def check_same_on_all_ranks(
    payload: bytes, what: str, fix: str, group: Group | None = None
) -> None:
    """Raise ``ValueError`` on every rank unless every rank passed the same ``payload``.

    Compares SHA-256 digests (one all-gather of 32 bytes per rank), so any payload size costs the
    same. Every rank must call it at the same point of the program.

    Args:
        payload: what must agree, serialised (e.g. the config as sorted JSON).
        what: its name in the message ("the configuration").
        fix: what to change when it differs.
        group: default :func:`world`.
    """
    group = group or world()
    if group.size() == 1:
        return
    digest = np.frombuffer(hashlib.sha256(payload).digest(), dtype=np.uint8).astype(np.int32)
    rows = _gather_rows(digest, group)  # (N, 32)
    differ = [r for r in range(group.size()) if not np.array_equal(rows[r], rows[0])]
    if differ:
        fail_together(
            ValueError(
                f"{what} differs between ranks: rank(s) {_rank_list(differ)} do not match rank 0."
                f" {fix}"
            ),
            group,
        )


def raise_if_any_rank_failed(
    error: BaseException | None, what: str, group: Group | None = None
) -> None:
    """Make a step that may fail on some ranks fail on all of them.

    Every rank calls this after the step, with the exception it caught (or None). If any rank
    failed, every rank raises: the failed ones re-raise their own error, the others a
    ``ValueError`` naming the failed ranks. Nobody is left waiting in a later collective.

    Args:
        error: the exception this rank caught, or None.
        what: the step, for the message ("resuming from the checkpoint").
        group: default :func:`world`.
    """
    group = group or world()
    if group.size() == 1:
        if error is not None:
            raise error
        return
    flags = _gather_rows(np.array([int(error is not None)], dtype=np.int32), group)[:, 0]  # (N,)
    failed = [r for r in range(group.size()) if flags[r]]
    if error is not None:
        fail_together(error, group)
    if failed:
        fail_together(
            ValueError(
                f"{what} failed on rank(s) {_rank_list(failed)} (see their error); every rank "
                "stops so that none waits for the others"
            ),
            group,
        )


def fingerprint(tree: Any) -> mx.array:
    """One exact ``uint32`` fingerprint per array of a parameter tree, shape (K,).

    ``f = sum_i bits(x_i) * (2654435761 * i + 1) mod 2**32`` over the raw bits of each array (its
    float32 / bfloat16 / float16 / integer bit patterns): integer arithmetic modulo ``2**32`` is
    exact and independent of the reduction order, so equal arrays give equal fingerprints on any
    device, and a single changed bit (or two swapped elements) changes it.
    """
    prints = []
    flat_tree: dict[str, mx.array] = dict(tree_flatten(tree))
    for x in flat_tree.values():
        flat = x.reshape(-1)
        if flat.dtype.size == 4:
            bits = flat.view(mx.uint32)
        elif flat.dtype.size == 2:
            bits = flat.view(mx.uint16).astype(mx.uint32)
        elif flat.dtype.size == 1:
            bits = flat.view(mx.uint8).astype(mx.uint32)
        else:  # 8-byte types: fold the two halves
            halves = flat.view(mx.uint32).reshape(-1, 2)  # (n, 2)
            bits = halves[:, 0] ^ (halves[:, 1] * mx.array(40503, dtype=mx.uint32))
        index = mx.arange(bits.size, dtype=mx.uint32)
        weights = index * mx.array(2654435761, dtype=mx.uint32) + mx.array(1, dtype=mx.uint32)
        prints.append(mx.sum(bits * weights))
    if not prints:
        return mx.zeros((0,), dtype=mx.uint32)
    return mx.stack(prints).astype(mx.uint32)


def check_same_weights(tree: Any, what: str, group: Group | None = None) -> None:
    """Raise ``ValueError`` on every rank unless every rank holds bit-identical arrays in ``tree``.

    One all-gather of :func:`fingerprint` (K numbers per rank). Data-parallel training keeps the
    ranks identical by construction (same seed and checkpoint, same averaged gradients), so a
    mismatch is a set-up error (different model files or seeds) or a broken backend.

    Args:
        tree: a parameter tree, e.g. ``model.parameters()``; same structure on every rank.
        what: its name and moment, for the message ("the policy at the start of training").
        group: default :func:`world`.
    """
    group = group or world()
    if group.size() == 1:
        return
    names = list(dict(tree_flatten(tree)))
    local = np.array(fingerprint(tree))  # (K,) uint32
    rows = _gather_rows(local, group)  # (N, K)
    differ = [r for r in range(group.size()) if not np.array_equal(rows[r], rows[0])]
    if differ:
        first = differ[0]
        bad = [names[k] for k in np.flatnonzero(rows[first] != rows[0])[:5]]
        fail_together(
            ValueError(
                f"{what} differs between ranks: rank(s) {_rank_list(differ)} do not match rank 0 "
                f"(e.g. {', '.join(bad)}). Every rank must load the same model files and "
                "checkpoint with the same seed"
            ),
            group,
        )


def check_same_settings_on_all_ranks(settings: Mapping[str, Any], group: Group) -> None:
    """Raise the same ``ValueError`` on every rank unless all ranks hold the same ``settings``
    (a run's config as a JSON-able dict, compared by hash): every later start-up check must see
    the same numbers everywhere."""
    check_same_on_all_ranks(
        json.dumps(settings, sort_keys=True).encode(),
        "the configuration",
        "launch every rank with the same --config file and --set overrides",
        group,
    )
