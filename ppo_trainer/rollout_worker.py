"""The asynchronous rollout worker (``config.async_rollout``): a second process that generates the
next batch while the trainer scores and updates the current one.

One step off-policy, as in asynchronous RLHF (Noukhovitch et al., 2024). At step ``k`` the trainer
takes batch ``k`` from the worker, sends it the policy's trainable weights (those of before update
``k``: LoRA adapters only when LoRA is on) with the prompts and PRNG keys of batch ``k + 1``, and
then scores and updates on batch ``k`` while the worker samples batch ``k + 1``. The worker returns
token ids, lengths and the behaviour log-probs (and entropy) of the sampling policy; they become
PPO's "old" log-probs, so the ratio ``pi_theta / pi_behaviour`` corrects for the lag. The first step
of a run (and of a resumed run) generates in the trainer itself.

Why a process and not a thread: MLX's CPU element-wise ops run on one thread per process, so a
second process is what lets generation and the update use two cores at once.

The child is started with the "spawn" context; it ignores SIGINT, SIGTERM and SIGHUP (a Ctrl-C or a
scheduler's SIGTERM reaches the whole process group: the trainer finishes its step, saves, and ends
the worker, with SIGKILL if it is busy) and calls :func:`base_setup.setup_blas` before it
imports mlx. It builds the policy as the trainer does (:func:`ppo_trainer.components.load_policy`)
and loads the trainer's trainable weights before every batch, from a safetensors file the trainer
writes atomically into a hidden ``.tmp-rollout-worker-<pid>`` folder of the run folder (removed at
the end, or by the next run's start after a kill). Errors in the child come back to the trainer as
:class:`RolloutWorkerError` with the child's traceback; a child that dies or stops answering is
detected while the trainer waits (liveness checked every half second, and a time limit).

This module does not import mlx at import time: the child imports it before its BLAS set-up.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import pickle
import shutil
import signal
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

import numpy as np

if TYPE_CHECKING:
    import mlx.core as mx
    from multiprocessing.connection import Connection

    from config.model_config import ModelConfig
    from ppo_trainer.generator import GenerationOutput
    from ppo_trainer.rollout import SamplingSettings

logger = logging.getLogger("ppo_mlx")

#: Longest the trainer waits for one batch (the worker's model loading included) before it gives
#: up with :class:`RolloutWorkerError`; a dead worker is noticed within half a second.
WORKER_TIMEOUT_S = 3600.0
_POLL_S = 0.5
_WEIGHTS_FILE = "policy.safetensors"
#: GenerationOutput's fields, in the order the worker sends them.
_FIELDS = ("responses", "lengths", "ended_with_stop", "logprobs", "entropy")


class RolloutWorkerError(RuntimeError):
    """The rollout worker failed (its traceback is in the message), died, or did not answer in
    time."""


@dataclass(frozen=True)
class WorkerSpec:
    """What the worker needs: the policy's model settings (model_name, dtype, LoRA, fast_math),
    the rollout sampling, its OpenBLAS thread count (None: OpenBLAS's default), and whether
    the run is on plain MLX (its config's ``plain_mlx``)."""

    model_config: ModelConfig
    sampling: SamplingSettings
    blas_threads: int | None
    plain_mlx: bool = False


def worker_blas_threads(threads: int | None) -> tuple[int | None, int | None]:
    """``(trainer's, worker's)`` OpenBLAS threads when the run's count is ``threads``: half each
    (at least 1), since both processes compute at once; None (no OpenBLAS) stays None."""
    if threads is None:
        return None, None
    share = max(1, threads // 2)
    return share, share


class RolloutWorker:
    """The trainer's side of the worker process (a context manager that ends it on exit).

    Args:
        spec: what the worker builds and how it samples.
        scratch_dir: the run folder; the weights go to a hidden folder inside it.
        timeout: longest wait for one batch (seconds).
    """

    def __init__(
        self, spec: WorkerSpec, scratch_dir: str | Path, timeout: float = WORKER_TIMEOUT_S
    ) -> None:
        self.timeout = timeout
        self._dir = Path(scratch_dir) / f".tmp-rollout-worker-{os.getpid()}"
        self._dir.mkdir(parents=True, exist_ok=True)
        ctx = mp.get_context("spawn")
        self._conn, child_conn = ctx.Pipe()
        self.process = ctx.Process(
            target=worker_main,
            # Pickled here and unpickled after the child's BLAS set-up: unpickling the spec
            # imports modules that import mlx.
            args=(child_conn, pickle.dumps(spec)),
            name="ppo-mlx-rollout-worker",
            daemon=True,
        )
        self.process.start()
        child_conn.close()  # the child's end lives in the child only: its death closes the pipe
        self._pending: tuple[int, list[list[int]]] | None = None
        #: The worker's BLAS (:class:`~base_setup.backend.BlasInfo` name), once it is ready.
        self.worker_blas: str | None = None

    def request(
        self,
        step: int,
        prompt_ids: list[list[int]],
        keys: mx.array,
        weights: dict[str, mx.array],
    ) -> None:
        """Ask for the responses of global step ``step`` (0-based: ``rollout_keys(seed, step,
        n)``) to ``prompt_ids``, sampled from ``keys`` by the policy with ``weights`` (its
        trainable parameters, by name; evaluated)."""
        import mlx.core as mx

        if self._pending is not None:
            raise RuntimeError("the rollout worker already has a batch to generate: take it first")
        tmp = self._dir / f"tmp-{_WEIGHTS_FILE}"
        mx.save_safetensors(str(tmp), weights)
        os.replace(tmp, self._dir / _WEIGHTS_FILE)  # the worker never reads half a file
        message = ("generate", step, str(self._dir / _WEIGHTS_FILE), prompt_ids, np.array(keys))
        try:
            self._conn.send(message)
        except (BrokenPipeError, ConnectionResetError, EOFError):
            self._raise_gone()
        self._pending = (step, [list(p) for p in prompt_ids])

    def take(self, step: int, prompt_ids: list[list[int]]) -> GenerationOutput | None:
        """The worker's responses for global step ``step`` if it was asked for exactly these
        prompts, else None (a batch asked for other prompts is received and dropped)."""
        if self._pending is None:
            return None
        asked_step, asked_ids = self._pending
        arrays = self._receive(asked_step)
        self._pending = None
        if asked_step != step or asked_ids != [list(p) for p in prompt_ids]:
            return None
        return _generation_output(arrays)

    def _receive(self, step: int) -> dict[str, np.ndarray]:
        deadline = time.monotonic() + self.timeout
        while True:
            while not self._conn.poll(_POLL_S):
                if not self.process.is_alive() and not self._conn.poll(0):
                    self._raise_gone()
                if time.monotonic() > deadline:
                    raise RolloutWorkerError(
                        f"the rollout worker (pid {self.process.pid}) did not return the batch "
                        f"of step {step + 1} within {self.timeout:.0f} s"
                    )
            try:
                message = self._conn.recv()
            except (EOFError, ConnectionResetError):
                self._raise_gone()
            kind = message[0]
            if kind == "ready":
                self.worker_blas = message[2]
                continue
            if kind == "error":
                raise RolloutWorkerError(f"the rollout worker failed:\n{message[1]}")
            if kind != "result" or message[1] != step:
                raise RolloutWorkerError(f"unexpected message from the rollout worker: {kind}")
            return dict(message[2])

    def _raise_gone(self) -> NoReturn:
        """Raise the worker's own error if it sent one before it exited, else its exit."""
        self.process.join(timeout=1.0)
        try:
            while self._conn.poll(0):
                message = self._conn.recv()
                if message[0] == "error":
                    raise RolloutWorkerError(f"the rollout worker failed:\n{message[1]}")
        except (EOFError, OSError):
            pass
        raise RolloutWorkerError(
            f"the rollout worker (pid {self.process.pid}) exited with code "
            f"{self.process.exitcode} before returning its batch (a signal is a negative code; "
            "-9 is often the kernel's out-of-memory killer: the worker holds a second copy of "
            "the policy)"
        )

    def close(self) -> None:
        """End the worker (at once if it is generating) and remove its weights folder."""
        if self.process.is_alive() and self._pending is None:
            try:
                self._conn.send(("stop",))
            except (BrokenPipeError, ConnectionResetError, EOFError):
                pass
            self.process.join(timeout=2.0)
        if self.process.is_alive():  # busy generating a batch no one will take, or stuck
            self.process.kill()
            self.process.join()
        self._conn.close()
        self._pending = None
        shutil.rmtree(self._dir, ignore_errors=True)

    def __enter__(self) -> RolloutWorker:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _generation_output(arrays: dict[str, np.ndarray]) -> GenerationOutput:
    import mlx.core as mx

    from ppo_trainer.generator import GenerationOutput

    fields = {name: mx.array(arrays[name]) for name in _FIELDS}
    return GenerationOutput(
        responses=fields["responses"],
        lengths=fields["lengths"],
        ended_with_stop=fields["ended_with_stop"],
        logprobs=fields["logprobs"],
        entropy=fields["entropy"],
    )


def worker_main(conn: Connection, spec: bytes) -> None:
    """The worker process (``spec``: a pickled :class:`WorkerSpec`): build the policy, then answer ``("generate", step, weights_path,
    prompt_ids, keys)`` messages with ``("result", step, arrays)`` until ``("stop",)`` or the
    trainer's end of the pipe closes. Any failure is sent back as ``("error", traceback)``."""
    # Ctrl-C, and SIGTERM sent to the whole process group (a scheduler's), are the trainer's to
    # act on: it finishes its step, saves, and ends this process (SIGKILL when it is busy).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)  # a closed terminal: the trainer's too
    from base_setup import setup_blas

    setup_blas()  # before mlx is imported in this process
    # Not an error handler: the child reports any failure, with its traceback, to the trainer,
    # which raises it; the child then exits.
    try:
        _serve(conn, pickle.loads(spec))
    except BaseException:
        try:
            conn.send(("error", traceback.format_exc()))
        except (BrokenPipeError, ConnectionResetError, EOFError):
            pass
        raise SystemExit(1)


def _serve(conn: Connection, spec: WorkerSpec) -> None:
    """The worker's whole life holds the run's scope (plain MLX or not, the buffer cache)."""
    from base_setup.backend import run_scope

    with run_scope(spec.plain_mlx):
        _serve_in_scope(conn, spec)


def _serve_in_scope(conn: Connection, spec: WorkerSpec) -> None:
    import mlx.core as mx
    from mlx.utils import tree_flatten

    from base_setup.backend import blas_info, run_blas_threads
    from ppo_trainer.components import load_policy
    from ppo_trainer.rollout import sample_responses

    if spec.blas_threads is not None:
        run_blas_threads(spec.blas_threads)
    policy = load_policy(spec.model_config, plain=spec.plain_mlx)
    flat: dict[str, Any] = dict(tree_flatten(policy.trainable_parameters()))
    trainable = {k: v.shape for k, v in flat.items()}
    conn.send(("ready", os.getpid(), blas_info().name))
    while True:
        try:
            message = conn.recv()
        except (EOFError, ConnectionResetError):
            return  # the trainer is gone
        if message[0] == "stop":
            return
        _, step, weights_path, prompt_ids, keys = message
        weights = mx.load(weights_path)
        assert isinstance(weights, dict)
        shapes = {k: v.shape for k, v in weights.items()}
        if shapes != trainable:
            raise ValueError(
                f"the trainer's policy weights do not match the worker's policy (missing "
                f"{sorted(set(trainable) - set(shapes))[:5]}, extra "
                f"{sorted(set(shapes) - set(trainable))[:5]}, or other shapes): async_rollout "
                "builds the worker's policy from the config; the trainer's must be built the same way"
            )
        policy.load_weights(list(weights.items()), strict=False)
        gen = sample_responses(policy, prompt_ids, spec.sampling, mx.array(keys))
        arrays = {name: np.array(getattr(gen, name)) for name in _FIELDS}
        conn.send(("result", step, arrays))
