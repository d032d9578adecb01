"""training/distillation_loss.py: TRL's generalized JSD, against TRL 1.12's own function (numbers
recorded by tests/trl_gkd_reference.py in a throwaway venv) and a naive float64 loop."""

from __future__ import annotations

import json
import math
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from tests import trl_gkd_reference as trl_ref
from training.distillation_loss import generalized_jsd_loss

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
