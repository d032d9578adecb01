"""The loss side of reasoning RL: think / answer region weights, the high-entropy token mask
(``top_entropy_quantile``), and the SFT loss mixed into the policy's update (``sft_coef``),
each against a naive loop."""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
import pytest

from config.ppo_config import PPOConfig
from finetune.tokenize import SFTExample, collate_sft
from ppo_trainer.sft_mix import SFTMix, sft_stream_indices
from ppo_trainer.update import Learner, policy_loss_fn, ppo_epochs, think_tags_for
from tests.test_update import (
    MASK,
    OLD,
    PROMPT_LENGTHS,
    QUERY_RESPONSES,
    REF,
    SEQUENCE_ADVANTAGES,
    TEMPERATURE,
    TOKEN_ADVANTAGES,
    Bigram,
    batch,
    config,
    naive_logprobs,
    scoring_tokens,
)
from token_attribution.token_weights import (
    response_region_weights,
    think_region_mask,
    top_entropy_mask,
)
from training.policy_loss import grpo_policy_loss, ppo_policy_loss, rloo_policy_loss

# ---------------------------------------------------------------- think / answer regions


def naive_think_region(tokens: list[int], start: list[int], end: list[int]) -> list[bool]:
    """A left-to-right scan: a token is inside when a block is open before it, or it belongs
    to an opening tag; a closing tag (its last token) closes the block."""

    def ends_at(tag: list[int], p: int) -> bool:
        return p + 1 >= len(tag) and tokens[p + 1 - len(tag) : p + 1] == tag

    inside, out = False, [False] * len(tokens)
    for p in range(len(tokens)):
        out[p] = inside
        if ends_at(start, p):
            inside = True
            for j in range(len(start)):
                out[p - j] = True
        if ends_at(end, p):
            inside = False
    return out


@pytest.mark.parametrize("start, end", [([6], [8]), ([6, 7], [8, 9]), ([6, 7, 5], [9])])
def test_think_region_mask_equals_a_scan(start: list[int], end: list[int]) -> None:
    rng = np.random.default_rng(len(start) * 10 + len(end))
    rows = []
    for _ in range(40):  # fillers, opening and closing tags in random order, some unbalanced
        row: list[int] = []
        while len(row) < 24:
            kind = rng.integers(0, 4)
            row += start if kind == 0 else end if kind == 1 else [int(rng.integers(0, 10))]
        rows.append(row[:24])
    got = np.array(think_region_mask(mx.array(rows), start, end))
    expected = np.array([naive_think_region(r, start, end) for r in rows])
    np.testing.assert_array_equal(got, expected)
    assert expected.any() and not expected.all()


def test_think_region_of_templates_that_open_or_close_the_block() -> None:
    """Ids: 1 <think>, 2 </think>, 0 other. A prompt ending in <think> (Qwen3 thinking, R1)
    starts its completion inside; Qwen3 with thinking off writes an empty closed block."""
    opened = [0, 0, 1, 0, 0, 2, 0, 0]  # prompt "x x <think>", completion "x x </think> x x"
    closed = [0, 1, 0, 2, 0, 0, 0, 0]  # prompt "x <think> x </think>", completion "x x x x"
    own = [0, 0, 0, 1, 0, 2, 0, 2]  # completion "<think> x </think> x </think>" (stray close)
    got = np.array(think_region_mask(mx.array([opened, closed, own]), [1], [2]))
    assert got[0].tolist() == [0, 0, 1, 1, 1, 1, 0, 0]
    assert got[1].tolist() == [0, 1, 1, 1, 0, 0, 0, 0]
    assert got[2].tolist() == [0, 0, 0, 1, 1, 1, 0, 0]
    # The response's weights: rows of different prompt lengths, right-padded.
    weights = response_region_weights(
        mx.array([opened, closed, own]), mx.array([3, 4, 2]), 4, ([1], [2]), 0.25, 2.0
    )
    np.testing.assert_array_equal(
        np.array(weights), [[0.25, 0.25, 0.25, 2], [2, 2, 2, 2], [2, 0.25, 0.25, 0.25]]
    )


def test_think_region_edges() -> None:
    """A row that is exactly the tag, a tag longer than the row, and empty tags."""
    assert np.array(think_region_mask(mx.array([[6, 7]]), [6, 7], [8])).tolist() == [[1, 1]]
    assert np.array(think_region_mask(mx.array([[6, 7]]), [6, 7, 5], [8])).tolist() == [[0, 0]]
    for start, end in (([], [8]), ([6], [])):
        with pytest.raises(ValueError, match="^think_start and think_end must be non-empty"):
            think_region_mask(mx.array([[6, 7]]), start, end)
    with pytest.raises(ValueError, match=r"\(B, L\)"):
        think_region_mask(mx.array([6, 7]), [6], [8])


# ---------------------------------------------------------------- high-entropy tokens


@pytest.mark.parametrize("quantile", [1.0, 0.8, 0.5, 0.2, 0.05, 0.02])
def test_top_entropy_mask_equals_numpy_quantile(quantile: float) -> None:
    """TRL's rule: keep action tokens with entropy >= the (1 - q)-quantile (linear) of the
    action tokens' entropies; ties at the threshold are kept."""
    rng = np.random.default_rng(0)
    entropy = rng.uniform(0, 3, size=(5, 7)).astype(np.float32)
    entropy[1, 2] = entropy[3, 4] = entropy[0, 0]  # ties
    mask = (rng.uniform(size=(5, 7)) < 0.7).astype(np.float32)
    mask[0, 0] = 1
    got = np.array(top_entropy_mask(mx.array(entropy), mx.array(mask), quantile))
    valid = mask > 0
    threshold = np.quantile(entropy[valid].astype(np.float64), 1 - quantile)
    expected = valid & (entropy >= threshold - 1e-6)
    np.testing.assert_array_equal(got, expected.astype(np.float32))
    # about the top q of the tokens (the three tied values may all sit at the threshold)
    assert got.sum() == pytest.approx(max(1, quantile * valid.sum()), abs=3.0)


def test_top_entropy_mask_with_one_or_no_action_token() -> None:
    entropy = mx.array([[0.5, 2.0, 1.0]])
    assert np.array(top_entropy_mask(entropy, mx.array([[0, 1, 0]]), 0.2)).tolist() == [[0, 1, 0]]
    assert np.array(top_entropy_mask(entropy, mx.array([[0, 0, 0]]), 0.2)).tolist() == [[0, 0, 0]]
    for bad in (0.0, 1.5):
        with pytest.raises(ValueError, match="top_entropy_quantile"):
            top_entropy_mask(entropy, mx.array([[1, 1, 1]]), bad)
    with pytest.raises(ValueError, match=r"but entropy has \(1, 3\)"):
        top_entropy_mask(entropy, mx.array([[1, 1]]), 0.5)


# ---------------------------------------------------------------- weighted policy losses

RNG = np.random.default_rng(11)
B, T = 3, 5
LOGP = RNG.uniform(-3, -0.5, size=(B, T))
W_OLD = LOGP + RNG.uniform(-0.3, 0.3, size=(B, T))
W_REF = LOGP + RNG.uniform(-0.5, 0.5, size=(B, T))
W_MASK = np.array([[1, 1, 1, 1, 0], [1, 1, 0, 0, 0], [1, 1, 1, 1, 1]], dtype=np.float32)
W_ADV_TOKEN = RNG.normal(size=(B, T))
W_ADV_SEQ = np.array([0.9, -1.3, 0.4])
WEIGHTS = RNG.choice([0.0, 0.3, 1.0, 2.0], size=(B, T))
LOW, HIGH, BETA, L_MAX = 0.2, 0.28, 0.1, 7


def clip_loss(ratio: float, adv: float) -> float:
    return max(-adv * ratio, -adv * min(max(ratio, 1 - LOW), 1 + HIGH))


def naive_weighted_loss(logp: np.ndarray, kind: str, beta: float = BETA) -> float:
    """The weighted losses of training.policy_loss's docstring, one token at a time."""
    rows = range(B)
    tokens = [[t for t in range(T) if W_MASK[b, t]] for b in rows]
    if kind == "ppo":
        terms = [
            WEIGHTS[b, t] * clip_loss(math.exp(logp[b, t] - W_OLD[b, t]), W_ADV_TOKEN[b, t])
            for b in rows
            for t in tokens[b]
        ]
        return sum(terms) / len(terms)
    if kind == "rloo":
        seq = [
            clip_loss(
                math.exp(sum(WEIGHTS[b, t] * (logp[b, t] - W_OLD[b, t]) for t in tokens[b])),
                W_ADV_SEQ[b],
            )
            for b in rows
        ]
        return sum(seq) / B
    loss_type, level = kind.split("/")
    per_token: dict[tuple[int, int], float] = {}
    for b in rows:
        n = len(tokens[b])
        seq_ratio = math.exp(sum(WEIGHTS[b, t] * (logp[b, t] - W_OLD[b, t]) for t in tokens[b]) / n)
        for t in tokens[b]:
            d = W_REF[b, t] - logp[b, t]
            kl = math.exp(d) - d - 1
            if level == "token":
                surrogate = clip_loss(math.exp(logp[b, t] - W_OLD[b, t]), W_ADV_SEQ[b])
                per_token[b, t] = WEIGHTS[b, t] * (surrogate + beta * kl)
            else:
                per_token[b, t] = clip_loss(seq_ratio, W_ADV_SEQ[b]) + WEIGHTS[b, t] * beta * kl
    if loss_type == "grpo":
        return sum(sum(per_token[b, t] for t in tokens[b]) / len(tokens[b]) for b in rows) / B
    total = sum(per_token.values())
    if loss_type == "dr_grpo":
        return total / (B * L_MAX)
    return total / sum(len(t) for t in tokens)  # dapo, bnpo


def weighted_loss(
    logp: mx.array, kind: str, weights: mx.array | None, beta: float = BETA
) -> mx.array:
    old, mask = mx.array(W_OLD.astype(np.float32)), mx.array(W_MASK)
    if kind == "ppo":
        adv = mx.array(W_ADV_TOKEN.astype(np.float32))
        return ppo_policy_loss(logp, old, adv, mask, LOW, cliprange_high=HIGH, weights=weights)[0]
    adv = mx.array(W_ADV_SEQ.astype(np.float32))
    if kind == "rloo":
        return rloo_policy_loss(logp, old, adv, mask, LOW, cliprange_high=HIGH, weights=weights)[0]
    loss_type, level = kind.split("/")
    ref = mx.array(W_REF.astype(np.float32))
    options: dict[str, Any] = dict(loss_type=loss_type, importance_sampling_level=level)
    return grpo_policy_loss(
        logp, old, ref, adv, mask, LOW, beta, cliprange_high=HIGH, max_completion_length=L_MAX,
        weights=weights, **options,
    )[0]  # fmt: skip


KINDS = ["ppo", "rloo", "grpo/token", "dr_grpo/token", "dapo/token", "bnpo/token"]
KINDS += ["grpo/sequence", "dapo/sequence"]


@pytest.mark.parametrize("kind", KINDS)
def test_weighted_policy_loss_equals_a_naive_loop(kind: str) -> None:
    """Value and gradient (float64 finite differences of the naive loop) of each loss with
    per-token weights; without weights the loss is the unweighted one, bit for bit."""
    weights = mx.array(WEIGHTS.astype(np.float32))
    logp = mx.array(LOGP.astype(np.float32))
    loss, grad = mx.value_and_grad(lambda x: weighted_loss(x, kind, weights))(logp)
    assert float(loss) == pytest.approx(naive_weighted_loss(LOGP, kind), rel=1e-5, abs=1e-7)
    expected = np.zeros((B, T))
    for index in np.ndindex(B, T):
        up, down = LOGP.copy(), LOGP.copy()
        up[index] += 1e-6
        down[index] -= 1e-6
        expected[index] = (naive_weighted_loss(up, kind) - naive_weighted_loss(down, kind)) / 2e-6
    np.testing.assert_allclose(np.array(grad), expected, rtol=1e-3, atol=1e-5)
    assert np.abs(expected).max() > 0.01
    # A weight-0 token gets no gradient from the surrogate (token-level) or at all (RLOO).
    if kind in ("ppo", "rloo") or kind.endswith("/token"):
        assert np.all(np.array(grad)[(WEIGHTS == 0) & (W_MASK > 0)] == 0)
    ones = mx.ones((B, T))
    plain = weighted_loss(logp, kind, None)
    assert float(weighted_loss(logp, kind, ones)) == float(plain)
    assert float(plain) != pytest.approx(float(loss), abs=1e-4)


@pytest.mark.parametrize("kind", ["grpo/token", "grpo/sequence"])
def test_weighted_grpo_loss_with_a_kl_weight_of_one(kind: str) -> None:
    weights = mx.array(WEIGHTS.astype(np.float32))
    loss = weighted_loss(mx.array(LOGP.astype(np.float32)), kind, weights, beta=1.0)
    assert float(loss) == pytest.approx(naive_weighted_loss(LOGP, kind, 1.0), rel=1e-5)


def test_weights_must_have_the_tokens_shape() -> None:
    logp = mx.array(LOGP.astype(np.float32))
    for kind in ("ppo", "rloo", "grpo/token"):
        with pytest.raises(ValueError, match=r"^weights has shape \(3, 4\) but per_token has"):
            weighted_loss(logp, kind, mx.ones((B, T - 1)))


# ---------------------------------------------------------------- through policy_loss_fn


def bigram_entropy(table: np.ndarray, temperature: float) -> np.ndarray:
    logits = table[scoring_tokens()] / temperature  # (B, T, V)
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return -(p * np.log(p)).sum(-1)


@pytest.mark.parametrize("algorithm", ["grpo", "ppo", "rloo"])
def test_policy_loss_fn_weights_regions_and_entropy(algorithm: str) -> None:
    """policy_loss_fn's weights are the naive region weights (the tags found over prompt +
    response) times the naive high-entropy mask, passed to the algorithm's loss."""
    from tests.test_update import TABLE

    start, end = [int(QUERY_RESPONSES[0, 1])], [int(QUERY_RESPONSES[3, 3])]
    cfg = config(algorithm, think_loss_weight=0.3, answer_loss_weight=1.5,
                 top_entropy_quantile=0.5)  # fmt: skip
    policy = Bigram(TABLE)
    sequence = algorithm != "ppo"
    loss, _ = policy_loss_fn(cfg, (start, end))(policy, batch(sequence))

    regions = np.zeros(MASK.shape)
    for b, p in enumerate(PROMPT_LENGTHS):
        inside = naive_think_region(QUERY_RESPONSES[b].tolist(), start, end)
        regions[b] = [0.3 if inside[p + t] else 1.5 for t in range(MASK.shape[1])]
    assert (regions == 0.3).any() and (regions == 1.5)[MASK > 0].any()
    entropy = bigram_entropy(TABLE, TEMPERATURE)
    valid = MASK > 0
    keep = valid & (entropy >= np.quantile(entropy[valid], 0.5) - 1e-6)
    weights = mx.array((regions * keep).astype(np.float32))
    logp = mx.array(naive_logprobs(TABLE, TEMPERATURE).astype(np.float32))
    old, mask = mx.array(OLD.astype(np.float32)), mx.array(MASK)
    if algorithm == "grpo":
        adv = mx.array(SEQUENCE_ADVANTAGES.astype(np.float32))
        expected, _ = grpo_policy_loss(
            logp, old, mx.array(REF.astype(np.float32)), adv, mask, 0.2, cfg.beta,
            loss_type="bnpo", max_completion_length=cfg.max_new_tokens, weights=weights,
        )  # fmt: skip
    elif algorithm == "rloo":
        adv = mx.array(SEQUENCE_ADVANTAGES.astype(np.float32))
        expected, _ = rloo_policy_loss(logp, old, adv, mask, 0.2, weights=weights)
    else:
        adv = mx.array(TOKEN_ADVANTAGES.astype(np.float32))
        expected, _ = ppo_policy_loss(logp, old, adv, mask, 0.2, weights=weights)
    assert float(loss) == pytest.approx(float(expected), rel=1e-5, abs=1e-7)
    plain, _ = policy_loss_fn(config(algorithm))(policy, batch(sequence))
    assert float(plain) != pytest.approx(float(loss), abs=1e-4)


def fake_tokenizer(vocab: dict[str, int], template: str | None = None) -> Any:
    """A tokenizer whose ids are characters, with a BOS (99) when special tokens are added."""
    return SimpleNamespace(
        get_vocab=lambda: vocab,
        chat_template=template,
        encode=lambda text, add_special_tokens=True: [99] * add_special_tokens
        + [ord(c) for c in text],
    )


def test_think_tags_are_found_or_the_weights_refused() -> None:
    cfg = config("grpo", think_loss_weight=0.5, system_prompt=None)
    qwen3 = fake_tokenizer({"<think>": 7, "</think>": 8, "a": 0})
    assert think_tags_for(cfg, qwen3) == ([7], [8])
    in_template = fake_tokenizer({"a": 0}, "{{ '<|im_start|>assistant\\n<think>\\n' }}")
    assert think_tags_for(cfg, in_template) == ([ord(c) for c in "<think>"],
                                                [ord(c) for c in "</think>"])  # fmt: skip
    plain = fake_tokenizer({"a": 0}, "{{ messages }}")
    with pytest.raises(ValueError) as err:
        think_tags_for(cfg, plain)
    assert str(err.value) == (
        "think_loss_weight=0.5 and answer_loss_weight=1.0 weigh the tokens inside and after "
        "<think> ... </think>, but this model's vocabulary has no <think> token and neither its "
        "chat template nor system_prompt writes <think>: use a thinking model (Qwen3, an R1 "
        "distill), ask for the tags in system_prompt, or set both weights to 1.0"
    )
    asked = config("grpo", answer_loss_weight=2.0, system_prompt="Reason in <think> tags.")
    assert think_tags_for(asked, plain) is not None
    assert think_tags_for(config("grpo", system_prompt=None), plain) is None  # weights 1: none
    half = fake_tokenizer({"<think>": 7, "a": 0}, "{{ messages }}")  # no closing tag
    with pytest.raises(ValueError, match="no <think> token"):
        think_tags_for(cfg, half)
    no_template = SimpleNamespace(get_vocab=lambda: {"a": 0})
    with pytest.raises(ValueError, match="no <think> token"):
        think_tags_for(cfg, no_template)


def test_both_region_weights_zero_is_warned(caplog: pytest.LogCaptureFixture) -> None:
    """issue #47: think_loss_weight = answer_loss_weight = 0 weighs every response token 0, so
    the rewards train nothing, and nothing said so."""
    qwen3 = fake_tokenizer({"<think>": 7, "</think>": 8, "a": 0})
    with caplog.at_level("WARNING", logger="ppo_mlx"):
        half = config("grpo", think_loss_weight=0.5, answer_loss_weight=0.0, system_prompt=None)
        think_tags_for(half, qwen3)
        assert "weigh every response token 0" not in caplog.text
        zero = config("grpo", think_loss_weight=0.0, answer_loss_weight=0.0, system_prompt=None)
        assert think_tags_for(zero, qwen3) == ([7], [8])
    assert (
        "think_loss_weight and answer_loss_weight are both 0: they weigh every response token 0"
        in caplog.text
    )


# ---------------------------------------------------------------- SFT loss in the update


class BigramLM(Bigram):
    """The bigram table as a language model (the SFT loss calls the model on token ids)."""

    def __call__(self, input_ids: mx.array) -> mx.array:
        return self.table[input_ids]  # (B, L, V)


#: The SFT batches' padding: a token of test_update's V = 6 vocabulary (pad == a real token, as
#: when pad is EOS), so that the bigram table has a row for it; the mask keeps it out of the loss.
#: An id outside the vocabulary made the table lookup read past its end (a NaN, now and then).
SFT_PAD = 0
SFT_EXAMPLES = [
    SFTExample([1, 2, 3, 4], [0, 0, 1, 1]),
    SFTExample([5, 0, 2], [0, 1, 1]),
    SFTExample([3, 3, 1, 0, 4], [0, 0, 0, 1, 1]),
]


def naive_nll(table: np.ndarray, examples: list[SFTExample]) -> float:
    """Token mean over the targets of -log softmax(table[previous token])[target]."""
    terms = []
    for e in examples:
        for i in range(1, len(e)):
            if e.loss_mask[i]:
                logits = table[e.input_ids[i - 1]]
                terms.append(math.log(np.exp(logits).sum()) - logits[e.input_ids[i]])
    return sum(terms) / len(terms)


def test_sft_batch_loss_is_coef_times_the_naive_nll() -> None:
    from tests.test_update import TABLE

    cfg = config("grpo", sft_coef=0.3)
    loss, metrics = policy_loss_fn(cfg)(BigramLM(TABLE), collate_sft(SFT_EXAMPLES, SFT_PAD))
    assert float(metrics["sft_loss"]) == pytest.approx(naive_nll(TABLE, SFT_EXAMPLES), rel=1e-5)
    assert float(loss) == pytest.approx(0.3 * naive_nll(TABLE, SFT_EXAMPLES), rel=1e-5)


def test_update_with_sft_steps_on_policy_loss_plus_coef_times_nll() -> None:
    """One update (one minibatch of two micro-batches) plus the SFT batch: the loss is the
    policy loss + sft_coef * NLL, and the step is SGD on the sum of their gradients."""
    from tests.test_update import TABLE, naive_policy_loss

    cfg = config("grpo", sft_coef=0.3, loss_type="grpo")  # a sequence mean: any split of rows
    mix = SFTMix(SFT_EXAMPLES, batch_size=2, seed=0, pad_token_id=SFT_PAD)
    policy = BigramLM(TABLE)
    learner = Learner(policy, optim.SGD(0.1), nn.value_and_grad(policy, policy_loss_fn(cfg)),
                      "policy", "grpo", mix.next_batch)  # fmt: skip
    metrics = ppo_epochs(
        batch(True), [learner], num_ppo_epochs=1, num_mini_batches=1,
        gradient_accumulation_steps=2, max_grad_norm=math.inf, rng=np.random.default_rng(0),
        step=1,
    )  # fmt: skip
    taken = [SFT_EXAMPLES[i] for i in sft_stream_indices(0, 2, 3, 0)]
    assert mix.cursor == 2
    rows = list(range(4))
    nll = naive_nll(TABLE, taken)
    total = naive_policy_loss(TABLE, cfg, rows) + 0.3 * nll
    assert float(metrics[0]["loss/policy"]) == pytest.approx(total, rel=1e-5)
    assert float(metrics[0]["policy/sft_loss"]) == pytest.approx(nll, rel=1e-5)
    # The step: the gradient of policy loss (grpo: mean of the two micro-batches) + coef * NLL.
    reference = BigramLM(TABLE)
    grad_fn = nn.value_and_grad(reference, policy_loss_fn(cfg))
    grads = [grad_fn(reference, mb)[1]["table"] for mb in (batch(True)[0:2], batch(True)[2:4])]
    sft_grad = grad_fn(reference, collate_sft(taken, SFT_PAD))[1]["table"]
    expected = TABLE - 0.1 * np.array(0.5 * grads[0] + 0.5 * grads[1] + sft_grad)
    np.testing.assert_allclose(np.array(policy.table), expected, rtol=1e-5, atol=1e-6)


def test_sft_stream_is_shuffled_passes_continued_by_the_cursor() -> None:
    whole = sft_stream_indices(0, 12, 5, seed=3)
    assert sft_stream_indices(0, 7, 5, 3) + sft_stream_indices(7, 5, 5, 3) == whole
    assert sorted(whole[:5]) == sorted(whole[5:10]) == list(range(5))
    assert whole[:5] != whole[5:10]  # each pass its own order
    assert whole[:5] != sft_stream_indices(0, 5, 5, seed=4)  # the order follows the seed
    # The documented stream: pass e is default_rng([seed, e, 2]).permutation(num_examples).
    passes = [np.random.default_rng([3, e, 2]).permutation(5).tolist() for e in range(3)]
    assert whole == (passes[0] + passes[1] + passes[2])[:12]


def test_sft_stream_edges_and_refusals() -> None:
    assert sft_stream_indices(4, 3, 1, seed=0) == [0, 0, 0]  # one example
    assert sft_stream_indices(2, 0, 5, seed=0) == []  # nothing to take
    for args in [(0, 1, 0), (-1, 1, 5), (0, -1, 5)]:
        cursor, count, num_examples = args
        with pytest.raises(ValueError) as err:
            sft_stream_indices(cursor, count, num_examples, seed=0)
        assert str(err.value) == (
            f"need num_examples >= 1, count >= 0, cursor >= 0; got {num_examples}, {count}, "
            f"{cursor}"
        )
    with pytest.raises(ValueError) as err:
        SFTMix([], batch_size=2, seed=0, pad_token_id=SFT_PAD)
    assert str(err.value) == "sft_data holds no examples"
    mix = SFTMix(SFT_EXAMPLES, batch_size=2, seed=0, pad_token_id=SFT_PAD)
    mix.next_batch()
    mix.next_batch()
    assert mix.cursor == 4  # examples taken so far


def test_sft_coef_needs_its_data(tiny_model_dir: Path) -> None:
    with pytest.raises(ValueError, match="sft_data must be an SFT data file"):
        PPOConfig(model_name=str(tiny_model_dir), sft_coef=0.1)
    with pytest.raises(ValueError, match="sft_coef is 0"):
        PPOConfig(model_name=str(tiny_model_dir), sft_data="sft.jsonl")
    with pytest.raises(ValueError, match="top_entropy_quantile must be in"):
        PPOConfig(model_name=str(tiny_model_dir), top_entropy_quantile=1.5)


def test_load_sft_mix_reads_tokenises_and_batches_the_sft_data(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    from base_setup.tokenizer_setup import load_tokenizer
    from finetune.records import load_sft_data
    from finetune.tokenize import tokenize_sft
    from ppo_trainer.sft_mix import load_sft_mix

    tokenizer = load_tokenizer(tiny_model_dir)
    data = tmp_path / "sft.jsonl"
    records = [
        {"prompt": "Say hi.", "completion": " hi"},
        {"prompt": "Count:", "completion": " one two three four five six seven eight nine ten"},
        {"prompt": "Name a colour.", "completion": " blue"},
    ]
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    config = SimpleNamespace(
        sft_coef=0.0,
        sft_data=str(data),
        max_prompt_length=8,
        max_new_tokens=4,
        sft_batch_size=None,
        micro_batch_size=2,
        seed=5,
    )
    assert load_sft_mix(config, tokenizer) is None  # sft_coef 0: no mix, the data unread
    config.sft_coef = 0.1
    mix = load_sft_mix(config, tokenizer)
    assert mix is not None
    want = tokenize_sft(load_sft_data(str(data)), tokenizer, 12)  # prompt + new tokens
    assert [list(e.input_ids) for e in mix.examples] == [list(e.input_ids) for e in want]
    assert max(len(e.input_ids) for e in mix.examples) == 12  # the long one cut at 12
    assert (mix.batch_size, mix.seed, mix.cursor) == (2, 5, 0)  # micro_batch_size by default
    assert mix.pad_token_id == tokenizer.pad_token_id
    config.sft_batch_size = 3
    mix = load_sft_mix(config, tokenizer)
    assert mix is not None and mix.batch_size == 3


# ---------------------------------------------------------------- end to end


@pytest.mark.slow
def test_grpo_with_sft_coef_learns_the_sft_data_and_resumes_its_cursor(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """A GRPO step with sft_coef move every parameter and leave a lower NLL on the SFT
    examples than the same run without it; the checkpoint keeps the SFT cursor; region weights
    on a model with no think tag fail at construction, before any rollout."""
    from finetune.sft_trainer import sft_loss
    from ppo_trainer.ppo_trainer import PPOTrainer
    from token_attribution.sequences import next_token_scores
    from tests.test_ppo_trainer import PROMPTS, assert_all_changed, e_rate, trainable

    data = tmp_path / "sft.jsonl"
    data.write_text(
        "".join(f'{{"prompt": "{p}", "completion": " great great great"}}\n' for p in PROMPTS[:6])
    )
    settings: dict[str, Any] = dict(
        model_name=str(tiny_model_dir), algorithm="grpo", group_size=2, batch_size=2,
        max_new_tokens=4, num_ppo_epochs=1, num_mini_batches=1, learning_rate=3e-3, seed=0,
        progress_bar=False, log_rollouts_every=0, save_every=100, use_lora=False,
    )  # fmt: skip

    mix_settings: dict[str, Any] = dict(sft_coef=1.0, sft_data=str(data), sft_batch_size=3)

    def one_step(name: str, **extra: Any) -> tuple[PPOTrainer, dict[str, np.ndarray]]:
        cfg = PPOConfig(**settings, output_dir=str(tmp_path / name), **extra)
        trainer = PPOTrainer(cfg, reward_model=e_rate)
        before = trainable(trainer.policy)
        trainer.step(PROMPTS[:2])
        return trainer, before

    mixed, before = one_step("mixed", **mix_settings)
    assert_all_changed(before, trainable(mixed.policy))
    mix = mixed.updater.sft_mix
    assert mix is not None and mix.cursor == 3  # 1 update of 3 examples
    plain, _ = one_step("plain")
    sft = collate_sft(mix.examples, 0)

    def nll(trainer: PPOTrainer) -> float:
        scores = next_token_scores(trainer.policy, sft.input_ids)
        return float(sft_loss(scores.logprobs, scores.top, sft.loss_mask[:, 1:])[0])

    assert nll(mixed) < nll(plain) - 0.5
    saved = mixed.save_checkpoint()
    resumed = PPOTrainer(
        PPOConfig(**settings, output_dir=str(tmp_path / "mixed"), **mix_settings),
        reward_model=e_rate,
    )
    resumed.load_checkpoint(saved)
    assert resumed.updater.sft_mix is not None and resumed.updater.sft_mix.cursor == 3

    def no_rollout(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("a rollout ran")

    with pytest.raises(ValueError, match="think_loss_weight=0.5.*no <think> token"):
        PPOTrainer(
            PPOConfig(**settings, output_dir=str(tmp_path / "t"), think_loss_weight=0.5),
            reward_model=no_rollout,
        )
