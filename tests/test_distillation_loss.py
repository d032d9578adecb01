"""training/distillation_loss.py: TRL's generalized JSD, against TRL 1.12's own function (numbers
recorded by tests/trl_gkd_reference.py in a throwaway venv) and a naive float64 loop."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Callable

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from tests import trl_gkd_reference as trl_ref
from training.distillation_loss import chunked_generalized_jsd, generalized_jsd_loss

TRL_NUMBERS = Path(__file__).parent / "data" / "trl_gkd_reference.json"


def naive_jsd(
    student: np.ndarray, teacher: np.ndarray, beta: float, temperature: float
) -> np.ndarray:
    """Eq. 1 of Agarwal et al. written out per position, in float64: (B, T, V) elements whose
    sum over V is beta KL(T || M) + (1 - beta) KL(S || M), M = beta T + (1 - beta) S (KL(T || S)
    at beta 0, KL(S || T) at beta 1)."""
    out = np.zeros(student.shape)
    for b in range(student.shape[0]):
        for t in range(student.shape[1]):
            s = np.exp(
                student[b, t] / temperature - np.logaddexp.reduce(student[b, t] / temperature)
            )
            q = np.exp(
                teacher[b, t] / temperature - np.logaddexp.reduce(teacher[b, t] / temperature)
            )
            for v in range(student.shape[2]):
                if beta == 0:
                    out[b, t, v] = q[v] * math.log(q[v] / s[v])
                elif beta == 1:
                    out[b, t, v] = s[v] * math.log(s[v] / q[v])
                else:
                    m = beta * q[v] + (1 - beta) * s[v]
                    out[b, t, v] = beta * q[v] * math.log(q[v] / m) + (1 - beta) * s[v] * math.log(
                        s[v] / m
                    )
    return out


@pytest.mark.parametrize("case", trl_ref.CASES, ids=lambda c: trl_ref.case_key(*c))
def test_values_and_gradients_equal_trls_gkd_trainer(
    case: tuple[float, float, str, bool],
) -> None:
    beta, temperature, reduction, with_labels = case
    want = json.loads(TRL_NUMBERS.read_text())["cases"][trl_ref.case_key(*case)]
    student, teacher, labels = trl_ref.logits()
    label_array = mx.array(labels) if with_labels else None

    def loss_fn(s: mx.array) -> mx.array:
        loss = generalized_jsd_loss(
            s,
            mx.array(teacher),
            label_array,
            beta=beta,
            temperature=temperature,
            reduction=reduction,  # type: ignore[arg-type]
        )
        return loss.sum()

    loss = generalized_jsd_loss(
        mx.array(student),
        mx.array(teacher),
        label_array,
        beta=beta,
        temperature=temperature,
        reduction=reduction,  # type: ignore[arg-type]
    )
    np.testing.assert_allclose(np.array(loss), np.array(want["loss"]), rtol=2e-5, atol=1e-6)
    grad = mx.grad(loss_fn)(mx.array(student))
    np.testing.assert_allclose(np.array(grad), np.array(want["grad"]), rtol=1e-4, atol=1e-6)
    assert np.abs(np.array(grad)).max() > 1e-3  # the gradient is real


@pytest.mark.parametrize("beta", [0.0, 0.25, 0.5, 1.0])
@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_batchmean_equals_a_naive_loop(beta: float, temperature: float) -> None:
    student, teacher, labels = trl_ref.logits()
    elements = naive_jsd(student.astype(np.float64), teacher.astype(np.float64), beta, temperature)
    keep = labels != -100
    want = elements[keep].sum() / keep.sum()
    got = generalized_jsd_loss(
        mx.array(student), mx.array(teacher), mx.array(labels), beta=beta, temperature=temperature
    )
    assert got.item() == pytest.approx(want, rel=1e-5)
    no_labels = generalized_jsd_loss(
        mx.array(student), mx.array(teacher), beta=beta, temperature=temperature
    )
    assert no_labels.item() == pytest.approx(elements.sum() / student.shape[0], rel=1e-5)


def test_the_same_distribution_costs_nothing_and_pushes_nowhere() -> None:
    student, _, labels = trl_ref.logits()
    for beta in (0.0, 0.5, 1.0):
        loss, grad = mx.value_and_grad(
            lambda s: generalized_jsd_loss(s, mx.array(student), mx.array(labels), beta=beta)
        )(mx.array(student))
        assert abs(loss.item()) < 1e-6
        assert np.abs(np.array(grad)).max() < 1e-6


def test_a_position_left_out_gets_no_gradient() -> None:
    student, teacher, labels = trl_ref.logits()
    grad = mx.grad(
        lambda s: generalized_jsd_loss(s, mx.array(teacher), mx.array(labels), beta=0.5)
    )(mx.array(student))
    g = np.array(grad)
    assert np.all(g[labels == -100] == 0) and np.abs(g[labels != -100]).max() > 1e-3


def test_bad_inputs_are_named() -> None:
    s = mx.zeros((1, 2, 3))
    with pytest.raises(ValueError, match="same positions over the same vocabulary"):
        generalized_jsd_loss(s, mx.zeros((1, 2, 4)))
    with pytest.raises(ValueError, match="beta must be in"):
        generalized_jsd_loss(s, s, beta=1.5)
    with pytest.raises(ValueError, match="temperature must be > 0"):
        generalized_jsd_loss(s, s, temperature=0.0)
    with pytest.raises(ValueError, match="reduction must be"):
        generalized_jsd_loss(s, s, reduction="avg")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="labels"):
        generalized_jsd_loss(s, s, mx.zeros((1, 3), dtype=mx.int32))


@pytest.mark.parametrize("beta", [0.0, 0.3, 1.0])
@pytest.mark.parametrize("chunk_size", [1, 3, None])
def test_the_chunked_divergence_equals_the_unchunked_loss(
    beta: float, chunk_size: int | None
) -> None:
    """On random logits (identity heads) the chunked per-position divergence, averaged over the
    kept positions, is generalized_jsd_loss's batchmean, values and gradients; its chosen-token
    log-probs are the student's log-softmax at the labels."""
    rng = np.random.default_rng(0)
    student = mx.array(rng.normal(size=(2, 5, 11)).astype(np.float32))  # (B, T, V)
    teacher = mx.array(rng.normal(size=(2, 5, 11)).astype(np.float32))
    labels = rng.integers(0, 11, (2, 5))
    labels[0, 3:] = -100
    rows = mx.array(np.flatnonzero(labels.reshape(-1) != -100))  # the kept positions

    def unchunked(s: mx.array) -> mx.array:
        return generalized_jsd_loss(s, teacher, mx.array(labels), beta=beta, temperature=0.7)

    def chunked(s: mx.array) -> mx.array:
        jsd, _ = chunked_generalized_jsd(
            s.reshape(-1, 11)[rows],
            teacher.reshape(-1, 11)[rows],
            lambda h: h,
            lambda h: h,
            beta=beta,
            temperature=0.7,
            chunk_size=chunk_size,
        )
        return jsd.mean()

    np.testing.assert_allclose(np.array(chunked(student)), np.array(unchunked(student)), rtol=1e-6)
    want, got = mx.grad(unchunked)(student), mx.grad(chunked)(student)
    np.testing.assert_allclose(np.array(got), np.array(want), rtol=1e-5, atol=1e-7)
    assert np.abs(np.array(got)).max() > 1e-3
    kept = mx.array(labels.reshape(-1)[np.array(rows)])
    _, chosen = chunked_generalized_jsd(
        student.reshape(-1, 11)[rows],
        teacher.reshape(-1, 11)[rows],
        lambda h: h,
        lambda h: h,
        kept,
        beta=beta,
        temperature=0.7,
        chunk_size=chunk_size,
    )
    scaled = np.array(student).reshape(-1, 11)[np.array(rows)] / 0.7
    log_softmax = scaled - np.log(np.exp(scaled).sum(-1, keepdims=True))
    assert chosen is not None
    np.testing.assert_allclose(
        np.array(chosen), log_softmax[np.arange(len(kept)), np.array(kept)], rtol=1e-5
    )


@pytest.mark.parametrize("tied", [False, True])
def test_a_trainable_head_gets_the_gradient_of_the_unchunked_loss(tied: bool) -> None:
    """A student head with parameters (a linear layer, or a tied embedding's as_linear): the
    chunked loss's gradient of its weight equals that of the loss on the full logits."""
    rng = np.random.default_rng(1)
    hidden = mx.array(rng.normal(size=(7, 4)).astype(np.float32))  # (N, D)
    teacher_hidden = mx.array(rng.normal(size=(7, 4)).astype(np.float32))
    teacher_head = nn.Linear(4, 11)
    module: nn.Module = nn.Embedding(11, 4) if tied else nn.Linear(4, 11)
    head = module.as_linear if isinstance(module, nn.Embedding) else module
    labels = mx.array(rng.integers(0, 11, 7))

    def unchunked(h: mx.array) -> mx.array:
        logits = head(h)  # (N, V)
        jsd = generalized_jsd_loss(logits[None], teacher_head(teacher_hidden)[None]) / 7
        chosen = mx.take_along_axis(nn.log_softmax(logits), labels[:, None], axis=-1)
        return jsd + chosen.mean()

    def chunked(h: mx.array) -> mx.array:
        jsd, chosen = chunked_generalized_jsd(
            h, teacher_hidden, head, teacher_head, labels, chunk_size=2
        )
        assert chosen is not None
        return jsd.mean() + chosen.mean()

    want_loss, want = nn.value_and_grad(module, unchunked)(hidden)
    got_loss, got = nn.value_and_grad(module, chunked)(hidden)
    np.testing.assert_allclose(np.array(got_loss), np.array(want_loss), rtol=1e-5)
    for key in want:
        np.testing.assert_allclose(np.array(got[key]), np.array(want[key]), rtol=1e-4, atol=1e-6)


def test_the_chunks_bound_the_peak_memory() -> None:
    """The chunked loss and its gradient over 256 positions of a 32k vocabulary stay well under
    the unchunked loss's (its (N, V) logits and their gradient): the chunks run one at a time."""
    hidden = mx.random.normal((256, 64), key=mx.random.key(0))
    teacher_hidden = mx.random.normal((256, 64), key=mx.random.key(1))
    head, teacher_head = nn.Linear(64, 32_000, bias=False), nn.Linear(64, 32_000, bias=False)
    head.freeze()
    mx.eval(head.parameters(), teacher_head.parameters(), hidden, teacher_hidden)

    def peak(loss: Callable[[mx.array], mx.array]) -> float:
        mx.clear_cache()
        mx.reset_peak_memory()
        base = mx.get_active_memory()
        mx.eval(mx.value_and_grad(loss)(hidden))
        return float(mx.get_peak_memory() - base)

    full = peak(lambda h: generalized_jsd_loss(head(h)[None], teacher_head(teacher_hidden)[None]))
    chunks = peak(
        lambda h: chunked_generalized_jsd(h, teacher_hidden, head, teacher_head, chunk_size=16)[
            0
        ].sum()
    )
    assert chunks < full / 4, (chunks, full)
