"""Batched generation against one-prompt-at-a-time decoding with full forward passes."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from base_setup import seed_everything
from base_setup.lora_setup import LoraSettings, lora_modules
from models.policy_model import PolicyModel
from ppo_trainer.generator import (
    GenerationOutput,
    _sample,
    distinct_prompts,
    generate,
    inverse_cdf,
)

PROMPT_TEXTS = [
    "Review of the camera:",
    "Review of the sushi bar: The food was",
    "Hi",
    "Review of the documentary: I hated the plot and the pacing. The",
    "Review of the new phone: The battery",
]
PAD = 1


@pytest.fixture(scope="module")
def policy(tiny_model_dir: Path) -> PolicyModel:
    return PolicyModel.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="module")
def prompts(policy: PolicyModel) -> list[list[int]]:
    ids = [policy.tokenizer.encode(t) for t in PROMPT_TEXTS]
    assert len({len(p) for p in ids}) == len(ids)  # mixed lengths
    return ids


def _np(a: mx.array | None) -> np.ndarray:
    """The array as NumPy (its ``tolist``/``item`` are typed loosely enough for the checks)."""
    assert a is not None
    return np.array(a)


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def _naive_greedy(
    model: Any, prompt: list[int], max_new_tokens: int, stop: set[int]
) -> tuple[list[int], list[float]]:
    """One prompt, no cache: a full forward pass over the whole sequence at every step."""
    ids, logprobs = list(prompt), []
    for _ in range(max_new_tokens):
        logp = _log_softmax(np.array(model(mx.array([ids]))[0, -1]))
        token = int(np.argmax(logp))
        ids.append(token)
        logprobs.append(float(logp[token]))
        if token in stop:
            break
    return ids[len(prompt) :], logprobs


def _recomputed_logprobs(
    model: Any, prompts: list[list[int]], out: GenerationOutput, temperature: float
) -> list[np.ndarray]:
    """Log-probs of each response token from one full forward pass over prompt + response."""
    result = []
    for b, prompt in enumerate(prompts):
        n = int(_np(out.lengths)[b].item())
        response = _np(out.responses)[b, :n].tolist()
        logits = np.array(model(mx.array([prompt + response]))[0]) / temperature  # (L, V)
        logp = _log_softmax(logits[len(prompt) - 1 : len(prompt) - 1 + n])
        result.append(logp[np.arange(n), response])
    return result


def _check_padding(out: GenerationOutput, pad: int) -> None:
    width = out.responses.shape[1]
    for b in range(out.responses.shape[0]):
        n = int(_np(out.lengths)[b].item())
        assert _np(out.responses)[b, n:].tolist() == [pad] * (width - n)
        if out.logprobs is not None:
            assert _np(out.logprobs)[b, n:].tolist() == [0.0] * (width - n)


def test_batched_greedy_equals_one_at_a_time(policy: PolicyModel, prompts: list[list[int]]) -> None:
    out = generate(
        policy,
        prompts,
        max_new_tokens=12,
        temperature=0.0,
        stop_token_ids=[],
        pad_token_id=PAD,
        return_logprobs=True,
    )
    assert out.responses.dtype == mx.int32 and out.lengths.dtype == mx.int32
    assert out.logprobs is not None and out.logprobs.dtype == mx.float32
    assert out.responses.shape == (len(prompts), 12)
    assert _np(out.lengths).tolist() == [12] * len(prompts)
    assert _np(out.ended_with_stop).tolist() == [False] * len(prompts)
    for b, prompt in enumerate(prompts):
        tokens, logprobs = _naive_greedy(policy.model, prompt, 12, set())
        assert _np(out.responses)[b].tolist() == tokens, b
        assert np.allclose(_np(out.logprobs)[b], logprobs, atol=1e-4), b
    # Not a degenerate model: responses differ between prompts and contain several tokens.
    assert len({tuple(r) for r in _np(out.responses).tolist()}) == len(prompts)
    assert max(len(set(r)) for r in _np(out.responses).tolist()) > 3


def test_plain_mlx_lm_model_gives_the_same(policy: PolicyModel, prompts: list[list[int]]) -> None:
    kwargs: dict[str, Any] = dict(
        max_new_tokens=6, temperature=0.0, stop_token_ids=[0], pad_token_id=PAD
    )
    a = generate(policy, prompts, **kwargs)
    b = generate(policy.model, prompts, **kwargs)
    assert _np(a.responses).tolist() == _np(b.responses).tolist()


def test_stop_tokens_truncate_and_pad(policy: PolicyModel, prompts: list[list[int]]) -> None:
    free = generate(
        policy, prompts, max_new_tokens=10, temperature=0.0, stop_token_ids=[], pad_token_id=PAD
    )
    # Stop on a token prompt 0 produces at step 3 (a random model rarely emits EOS itself).
    stop = _np(free.responses)[0, 3].item()
    out = generate(
        policy,
        prompts,
        max_new_tokens=10,
        temperature=0.0,
        stop_token_ids=[stop, 0],
        pad_token_id=PAD,
        return_logprobs=True,
    )
    for b, prompt in enumerate(prompts):
        full = _np(free.responses)[b].tolist()
        expected_len = full.index(stop) + 1 if stop in full else 10
        assert _np(out.lengths)[b].item() == expected_len, b
        assert _np(out.ended_with_stop)[b].item() == (stop in full), b
        assert _np(out.responses)[b, :expected_len].tolist() == full[:expected_len]
        tokens, _ = _naive_greedy(policy.model, prompt, 10, {stop, 0})
        assert _np(out.responses)[b, :expected_len].tolist() == tokens
    assert _np(out.lengths)[0].item() <= 4 and _np(out.ended_with_stop)[0].item()
    assert out.responses.shape[1] == max(_np(out.lengths).tolist())
    _check_padding(out, PAD)


class _CountingModel(nn.Module):
    """Forwards to an mlx-lm model and counts the forward passes."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner
        self.calls = 0

    @property
    def layers(self) -> list[nn.Module]:
        return list(self.inner.layers)

    def __call__(self, x: mx.array, cache: Any = None) -> mx.array:
        self.calls += 1
        logits: mx.array = self.inner(x, cache=cache)
        return logits


def test_stops_early_when_every_sequence_stopped(
    policy: PolicyModel, prompts: list[list[int]]
) -> None:
    free = generate(
        policy, prompts, max_new_tokens=4, temperature=0.0, stop_token_ids=[], pad_token_id=PAD
    )
    # Every sequence stops within 3 tokens if its first three tokens are stop tokens.
    stops = sorted({t for row in _np(free.responses)[:, :3].tolist() for t in row})
    counting = _CountingModel(policy.model)
    out = generate(
        counting,
        prompts,
        max_new_tokens=50,
        temperature=0.0,
        stop_token_ids=stops,
        pad_token_id=PAD,
    )
    assert out.ended_with_stop.all().item()
    assert _np(out.lengths).tolist() == [1] * len(prompts)
    assert out.responses.shape == (len(prompts), 1)
    assert _np(out.responses)[:, 0].tolist() == _np(free.responses)[:, 0].tolist()
    # One prefill, one decoding step queued before the "all stopped" check, then it stops.
    assert counting.calls <= 3


@pytest.mark.slow
def test_sampling_is_reproducible_and_logprobs_are_unfiltered(
    policy: PolicyModel, prompts: list[list[int]]
) -> None:
    kwargs: dict[str, Any] = dict(
        max_new_tokens=16,
        temperature=0.7,
        top_p=0.9,
        top_k=20,
        stop_token_ids=[0],
        pad_token_id=PAD,
        return_logprobs=True,
    )
    seed_everything(123)
    a = generate(policy, prompts, **kwargs)
    seed_everything(123)
    b = generate(policy, prompts, **kwargs)
    seed_everything(124)
    c = generate(policy, prompts, **kwargs)
    assert _np(a.responses).tolist() == _np(b.responses).tolist()
    assert a.logprobs is not None and b.logprobs is not None
    assert mx.array_equal(a.logprobs, b.logprobs).item()
    assert _np(a.responses).tolist() != _np(c.responses).tolist()
    _check_padding(a, PAD)

    # log_softmax(logits / temperature) at the sampled token, before top-k / top-p filtering,
    # and every sampled token is inside the top-k set.
    recomputed = _recomputed_logprobs(policy.model, prompts, a, temperature=0.7)
    for b_idx, prompt in enumerate(prompts):
        n = int(_np(a.lengths)[b_idx].item())
        assert np.allclose(_np(a.logprobs)[b_idx, :n], recomputed[b_idx], atol=1e-4)
        response = _np(a.responses)[b_idx, :n].tolist()
        logits = np.array(policy.model(mx.array([prompt + response]))[0])
        for j, token in enumerate(response):
            rank = int((logits[len(prompt) - 1 + j] > logits[len(prompt) - 1 + j, token]).sum())
            assert rank < 20


@pytest.mark.slow
def test_filters_select_the_argmax(policy: PolicyModel, prompts: list[list[int]]) -> None:
    greedy = generate(
        policy, prompts, max_new_tokens=8, temperature=0.0, stop_token_ids=[], pad_token_id=PAD
    )
    seed_everything(0)
    top1 = generate(
        policy,
        prompts,
        max_new_tokens=8,
        temperature=1.0,
        top_k=1,
        stop_token_ids=[],
        pad_token_id=PAD,
    )
    nucleus = generate(
        policy,
        prompts,
        max_new_tokens=8,
        temperature=1.0,
        top_p=1e-6,
        stop_token_ids=[],
        pad_token_id=PAD,
    )
    assert _np(top1.responses).tolist() == _np(greedy.responses).tolist()
    assert _np(nucleus.responses).tolist() == _np(greedy.responses).tolist()


def test_lora_policy_generates_in_eval_mode(tiny_model_dir: Path, prompts: list[list[int]]) -> None:
    mx.random.seed(0)
    policy = PolicyModel.from_pretrained(
        tiny_model_dir, lora=LoraSettings(r=4, alpha=8.0, dropout=0.5)
    )
    for _, module in lora_modules(policy.model):
        module.lora_b = mx.random.normal(module.lora_b.shape) * 0.1
    kwargs: dict[str, Any] = dict(
        max_new_tokens=8,
        temperature=0.0,
        stop_token_ids=[],
        pad_token_id=PAD,
        return_logprobs=True,
    )
    expected = generate(policy, prompts, **kwargs)
    policy.train()  # dropout would make greedy decoding random; generation switches it off
    got = generate(policy, prompts, **kwargs)
    assert policy.training and policy.model.training  # mode restored
    assert _np(got.responses).tolist() == _np(expected.responses).tolist()
    assert got.logprobs is not None and expected.logprobs is not None
    assert mx.array_equal(got.logprobs, expected.logprobs).item()
    policy.eval()
    for b, prompt in enumerate(prompts):
        tokens, _ = _naive_greedy(policy.model, prompt, 8, set())
        assert _np(got.responses)[b].tolist() == tokens


def test_bad_inputs_raise(policy: PolicyModel) -> None:
    kwargs: dict[str, Any] = dict(
        max_new_tokens=4, temperature=1.0, stop_token_ids=[0], pad_token_id=PAD
    )
    with pytest.raises(ValueError, match="prompts is empty"):
        generate(policy, [], **kwargs)
    with pytest.raises(ValueError, match=r"prompts \[1\] are empty"):
        generate(policy, [[5, 6], []], **kwargs)
    with pytest.raises(ValueError, match="max_new_tokens"):
        generate(policy, [[5]], **{**kwargs, "max_new_tokens": 0})
    with pytest.raises(ValueError, match="temperature"):
        generate(policy, [[5]], **{**kwargs, "temperature": -1.0})
    with pytest.raises(ValueError, match="top_p"):
        generate(policy, [[5]], **kwargs, top_p=0.0)
    with pytest.raises(ValueError, match="top_k"):
        generate(policy, [[5]], **kwargs, top_k=-1)
    with pytest.raises(ValueError, match="context"):
        generate(policy, [[5] * 2000], **{**kwargs, "max_new_tokens": 100})


def test_sampling_entropy_equals_the_forward_entropy(
    policy: PolicyModel, prompts: list[list[int]]
) -> None:
    """The entropy the sampler returns is that of log_softmax(logits / temperature) at each step,
    as ``entropy_from_logits`` computes it from a full forward pass; 0 after the end."""
    from token_attribution.logprob_computer import entropy_from_logits

    seed_everything(5)
    out = generate(
        policy,
        prompts,
        max_new_tokens=12,
        temperature=0.8,
        stop_token_ids=[0],
        pad_token_id=PAD,
        return_logprobs=True,
    )
    assert out.entropy is not None
    entropy = _np(out.entropy)
    for b, prompt in enumerate(prompts):
        n = int(_np(out.lengths)[b].item())
        response = _np(out.responses)[b, :n].tolist()
        logits = policy.model(mx.array([prompt + response]))[:, len(prompt) - 1 : -1]
        want = np.array(entropy_from_logits(logits / 0.8))[0]
        np.testing.assert_allclose(entropy[b, :n], want, atol=1e-4)
        assert (entropy[b, n:] == 0).all()


def testinverse_cdf_matches_a_naive_search() -> None:
    """First index whose cumulative weight exceeds u * total, zero weights never taken, and u
    whose product with the total rounds up to the total gives the last positive weight."""
    rng = np.random.default_rng(0)
    weights = rng.random((64, 9)).astype(np.float32)
    weights[rng.random((64, 9)) < 0.3] = 0.0
    weights[:, 4] += 0.1  # every row has a positive total
    weights[-1, 5:] = 0.0  # trailing zeros
    uniform = rng.random((64, 1)).astype(np.float32)
    uniform[-2:] = np.float32(1.0 - 2**-24)  # the largest float32 below 1
    got = np.array(inverse_cdf(mx.array(weights), mx.array(uniform)))
    for row, u, index in zip(weights.astype(np.float64), uniform[:, 0], got):
        cdf = np.cumsum(row)
        above = np.flatnonzero(cdf > u * cdf[-1])
        want = above[0] if above.size else np.flatnonzero(row)[-1]
        assert index == want or (row[index] > 0 and abs(cdf[index - 1] - u * cdf[-1]) < 1e-6)
        assert row[index] > 0


def testinverse_cdf_equals_the_two_pass_search_with_rounding_up() -> None:
    """The capped count gives the very index of the count-then-clamp search it replaced (the
    first index above u * total, clamped to the first index where the CDF reaches its total),
    including u = the largest float32 below 1, u = 1 and trailing zero weights."""
    rng = np.random.default_rng(1)
    weights = rng.random((512, 300)).astype(np.float32) ** 8
    weights[rng.random((512, 300)) < 0.5] = 0.0
    weights[:, 0] += 1e-3
    weights[::3, 200:] = 0.0  # trailing zeros
    uniform = rng.random((512, 1)).astype(np.float32)
    uniform[::4] = np.float32(1.0 - 2**-24)
    uniform[::5] = 1.0  # u * total == total: the clamp itself (exact float math never rounds up)
    w, u = mx.array(weights), mx.array(uniform)
    cdf = mx.cumsum(w, axis=-1)
    total = cdf[:, -1:]
    two_pass = mx.minimum((cdf <= u * total).sum(axis=-1), mx.argmax(cdf >= total, axis=-1))
    assert np.array_equal(np.array(inverse_cdf(w, u)), np.array(two_pass))


@pytest.mark.slow
@pytest.mark.parametrize("with_keys", [False, True])
@pytest.mark.parametrize("top_k", [0, 3])
def test_sampled_tokens_follow_the_softmax(with_keys: bool, top_k: int) -> None:
    """Token frequencies over many rows match softmax(logits / T) (renormalised over the top-k
    tokens when filtered) within 5 standard errors; log-probs and entropy are the unfiltered
    distribution's."""
    rows, temperature = 40_000, 0.8
    logits_1 = np.array([2.0, -1.0, 0.5, 1.5, -3.0, 0.0], dtype=np.float32)
    logits = mx.broadcast_to(mx.array(logits_1), (rows, logits_1.size))
    keys = mx.random.split(mx.random.key(7), rows) if with_keys else None
    mx.random.seed(3)
    tokens, token_logprobs, entropy = _sample(
        logits, temperature, 1.0, top_k, keys, with_entropy=True
    )
    scaled = logits_1.astype(np.float64) / temperature
    log_probs = scaled - np.log(np.exp(scaled).sum())
    probs = np.exp(log_probs)
    want = probs.copy()
    if top_k:
        want[np.argsort(-probs)[top_k:]] = 0.0
        want /= want.sum()
    counts = np.bincount(np.array(tokens), minlength=logits_1.size) / rows
    stderr = np.sqrt(want * (1 - want) / rows)
    assert np.all(np.abs(counts - want) <= 5 * stderr + 1e-12), (counts, want)
    assert np.allclose(np.array(token_logprobs), log_probs[np.array(tokens)], atol=1e-5)
    assert entropy is not None
    assert np.allclose(np.array(entropy), -(probs * log_probs).sum(), atol=1e-5)


def test_rows_with_keys_do_not_depend_on_the_batch() -> None:
    keys = mx.random.split(mx.random.key(11), 6)
    logits = mx.random.normal((6, 50), key=mx.random.key(1))
    full, _, _ = _sample(logits, 1.0, 1.0, 0, keys)
    part, _, _ = _sample(logits[2:4], 1.0, 1.0, 0, keys[2:4])
    assert np.array(full)[2:4].tolist() == np.array(part).tolist()


def test_sampled_logprobs_are_the_trainers_log_softmax_bit_for_bit() -> None:
    """The rollout's old log-probs equal what the PPO loss computes from the same logits, to the
    last bit: a first-epoch ratio is then exactly 1 wherever the logits agree."""
    from token_attribution.logprob_computer import selective_log_softmax

    logits = mx.random.normal((32, 300), key=mx.random.key(4)) * 4
    keys = mx.random.split(mx.random.key(5), 32)
    tokens, token_logprobs, _ = _sample(logits, 1.0, 1.0, 0, keys)
    trainer = selective_log_softmax(logits[:, None, :], tokens[:, None])[:, 0]
    assert np.array_equal(np.array(token_logprobs), np.array(trainer))


def test_distinct_prompts_map_every_row_to_its_prompt() -> None:
    prompts = [[5, 6], [7], [5, 6], [7], [8, 9, 1], [5, 6]]
    distinct, rows = distinct_prompts(prompts)
    assert distinct == [[5, 6], [7], [8, 9, 1]]
    assert rows is not None and np.array(rows).tolist() == [0, 1, 0, 1, 2, 0]
    assert distinct_prompts([[1], [2]]) == ([[1], [2]], None)


@pytest.mark.parametrize("lora", [False, True])
def test_groups_prefilled_once_sample_what_a_full_prefill_samples(
    tiny_model_dir: Path, prompts: list[list[int]], lora: bool
) -> None:
    """GRPO's batches: each prompt ``group_size`` times in a row (and a repeat elsewhere). Its
    prefill once, its cache repeated: the same tokens as every row prefilled, with per-row keys
    (the trainer's) and with the global state; log-probs and entropies equal to float32 rounding
    (a matmul's rows depend on its row count in OpenBLAS, so a 3-row prefill rounds differently
    from a 13-row one)."""
    model = PolicyModel.from_pretrained(
        tiny_model_dir, lora=LoraSettings(r=4, alpha=8.0, dropout=0.0) if lora else None
    )
    grouped = [p for p in prompts[:3] for _ in range(4)] + [prompts[0]]  # (13 rows, 3 prompts)
    kwargs: dict[str, Any] = dict(
        max_new_tokens=10, temperature=1.0, top_p=0.9, stop_token_ids=[0], pad_token_id=PAD
    )
    for keys in (mx.random.split(mx.random.key(3), len(grouped)), None):
        outs = []
        for prefill_once in (True, False):
            seed_everything(7)
            outs.append(
                generate(
                    model,
                    grouped,
                    return_logprobs=True,
                    keys=keys,
                    prefill_once=prefill_once,
                    **kwargs,
                )
            )
        once, full = outs
        for field in ("responses", "lengths", "ended_with_stop"):
            a, b = _np(getattr(once, field)), _np(getattr(full, field))
            assert a.shape == b.shape and np.array_equal(a, b), field
        for field in ("logprobs", "entropy"):
            a, b = _np(getattr(once, field)), _np(getattr(full, field))
            np.testing.assert_allclose(a, b, rtol=0, atol=1e-4, err_msg=field)
        # The samples of a group differ (each row draws its own tokens).
        assert len({tuple(r) for r in _np(once.responses)[:4].tolist()}) > 1


def test_stop_strings_end_a_response_at_the_token_that_completes_them(
    policy: PolicyModel, prompts: list[list[int]]
) -> None:
    from ppo_trainer.generator import cut_after_stop_string
    from ppo_trainer.rollout import decode_completions

    def decode(ids: Sequence[int]) -> str:
        return str(policy.tokenizer.decode(list(ids), skip_special_tokens=True))

    settings: dict[str, Any] = dict(max_new_tokens=12, temperature=0.0, pad_token_id=PAD)
    free = generate(policy, prompts, stop_token_ids=[], **settings)
    rows = _np(free.responses).tolist()
    stop = decode(rows[0][3:5])  # completed by row 0's token 4 (perhaps earlier, elsewhere)
    assert stop.strip()
    out = generate(
        policy, prompts, stop_token_ids=[], stop_strings=[stop], decode=decode, **settings
    )
    _check_padding(out, PAD)
    assert out.stopped_by_string is not None
    for b, row in enumerate(rows):
        # Naive: the first prefix whose whole decoded text holds the stop string.
        ends = [k + 1 for k in range(len(row)) if stop in decode(row[: k + 1])]
        length = ends[0] if ends else len(row)
        assert int(out.lengths[b]) == length
        assert _np(out.responses)[b, :length].tolist() == row[:length]
        assert bool(out.ended_with_stop[b]) == bool(out.stopped_by_string[b]) == bool(ends)
    assert int(out.lengths[0]) <= 5
    texts = decode_completions(out, decode, [stop])
    for b, text in enumerate(texts):
        whole = decode(_np(out.responses)[b, : int(out.lengths[b])].tolist())
        assert text == (cut_after_stop_string(whole, [stop]) if out.stopped_by_string[b] else whole)
        if out.stopped_by_string[b]:
            assert text.endswith(stop) and text.count(stop) == 1
    with pytest.raises(ValueError, match="stop_strings needs decode"):
        generate(policy, prompts, stop_token_ids=[], stop_strings=["x"], **settings)


def test_cut_after_stop_string_keeps_the_first_string_to_end() -> None:
    from ppo_trainer.generator import cut_after_stop_string

    assert cut_after_stop_string("a</b>c</b>", ["</b>"]) == "a</b>"
    assert cut_after_stop_string("xy END. more", ["END", "y"]) == "xy"
    assert cut_after_stop_string("no stop here", ["END"]) == "no stop here"
    # An episode's last turn: after the stop strings of earlier turns (and of tool results).
    assert cut_after_stop_string("a</b>c</b>d", ["</b>"], last=True) == "a</b>c</b>"
    assert cut_after_stop_string("xy END.y more", ["END", "y"], last=True) == "xy END.y"
    assert cut_after_stop_string("no stop here", ["END"], last=True) == "no stop here"


def test_decode_completions_cuts_an_episode_after_its_last_turns_stop_string() -> None:
    from ppo_trainer.generator import GenerationOutput
    from ppo_trainer.rollout import decode_completions

    words = {1: "call</c>", 2: " tool", 3: " done</c>!", 4: "<eot>", 5: "x"}
    # Two turns with a tool result between; the last one ended by the string (row 0, whose
    # last token carried "!" past it) or by a stop token (row 1).
    gen = GenerationOutput(
        responses=mx.array([[1, 2, 3], [1, 5, 4]]),
        lengths=mx.array([3, 3]),
        ended_with_stop=mx.array([True, True]),
        stopped_by_string=mx.array([True, False]),
        action_mask=mx.array([[1.0, 0.0, 1.0], [1.0, 0.0, 1.0]]),
        turn_spans=[[(0, 1), (2, 3)], [(0, 1), (2, 3)]],
    )
    texts = decode_completions(gen, lambda ids: "".join(words[i] for i in ids), ["</c>"])
    assert texts == ["call</c> tool done</c>", "call</c>x"]


def test_stop_strings_settings_are_checked() -> None:
    from config.ppo_config import PPOConfig
    from ppo_trainer.rollout import SamplingSettings

    cfg = PPOConfig(model_name="m", stop_strings=["</answer>"])
    assert SamplingSettings.from_config(cfg, [2], 0).stop_strings == ("</answer>",)
    with pytest.raises(ValueError, match="stop_strings must be a list of non-empty strings"):
        PPOConfig(model_name="m", stop_strings=[""])
    with pytest.raises(ValueError, match="stop_strings must be null when async_rollout is on"):
        PPOConfig(model_name="m", stop_strings=["x"], async_rollout=True)


def test_sampling_memory_does_not_grow_with_the_response_length(policy: PolicyModel) -> None:
    """Each step's entropy is evaluated with its step: left lazy, it held that step's (B, V)
    probabilities until the end, two (B, T, V) arrays' worth of memory at the last step."""
    rows, vocab = 8, int(policy.model.args.vocab_size)
    ids = [[5, 17, 42, 99, 7]] * rows

    def peak_bytes(new_tokens: int) -> int:
        mx.clear_cache()
        mx.reset_peak_memory()
        start = mx.get_active_memory()
        generate(
            policy,
            ids,
            max_new_tokens=new_tokens,
            temperature=1.0,
            stop_token_ids=[],
            pad_token_id=0,
            return_logprobs=True,
        )
        return int(mx.get_peak_memory() - start)

    short, long = peak_bytes(4), peak_bytes(32)
    one_step = rows * vocab * 4  # one (B, V) float32 array
    assert long - short < 28 * one_step // 4, (short, long, one_step)
