"""Multi-turn generation keeping the KV cache, against re-running generation from scratch each
turn (one episode at a time, the whole history re-prefilled)."""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Sequence

import mlx.core as mx
import numpy as np
import pytest

from models.policy_model import PolicyModel
from ppo_trainer.generator import generate
from ppo_trainer.multi_turn import generate_turns, turn_ends

PAD = 1
MAX_NEW = 40


@pytest.fixture(scope="module")
def policy(tiny_model_dir: Path) -> PolicyModel:
    return PolicyModel.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="module")
def prompts(policy: PolicyModel) -> list[list[int]]:
    texts = ["Review of the camera:", "Hi", "The food was", "Review of the new phone: The"]
    return [policy.tokenizer.encode(t) for t in texts]


@pytest.fixture(scope="module")
def stops(policy: PolicyModel, prompts: list[list[int]]) -> list[int]:
    """Tokens the greedy model emits early, so that turns end after a few tokens."""
    out = generate(
        policy, prompts, max_new_tokens=6, temperature=0, stop_token_ids=[], pad_token_id=PAD
    )
    return sorted({int(t) for t in np.array(out.responses)[:, 2:5].reshape(-1)})


def _context(row: int, turn: int) -> list[int] | None:
    """Row ``row`` gets ``row % 3 + 1`` context turns, of different lengths."""
    if turn > row % 3:
        return None
    return [(7 * row + 5 * turn + j) % 400 + 20 for j in range(2 + row + 3 * turn)]


def _decode(policy: PolicyModel) -> Callable[[list[int]], str]:
    return lambda ids: str(policy.tokenizer.decode(ids, skip_special_tokens=True))


def _reference(
    policy: PolicyModel,
    prompt: list[int],
    row: int,
    stops: list[int],
    max_turns: int | None,
    stop_strings: Sequence[str] = (),
) -> tuple[list[int], list[int], list[float]]:
    """One episode re-generated from scratch (prompt + whole history) at every turn."""
    history: list[int] = []
    action: list[int] = []
    logprobs: list[float] = []
    turn = 0
    while True:
        out = generate(
            policy,
            [prompt + history],
            max_new_tokens=MAX_NEW - len(history),
            temperature=0,
            stop_token_ids=stops,
            pad_token_id=PAD,
            return_logprobs=True,
            prefill_once=False,
            stop_strings=stop_strings,
            decode=_decode(policy),
        )
        n = int(np.array(out.lengths)[0])
        history += np.array(out.responses)[0, :n].tolist()
        action += [1] * n
        assert out.logprobs is not None
        logprobs += np.array(out.logprobs)[0, :n].tolist()
        turn += 1
        if not bool(out.ended_with_stop[0].item()) or (max_turns and turn >= max_turns):
            return history, action, logprobs
        ctx = _context(row, turn - 1)
        if ctx is None or len(history) + len(ctx) >= MAX_NEW:
            return history, action, logprobs
        history += ctx
        action += [0] * len(ctx)
        logprobs += [0.0] * len(ctx)


#: Frequent in the greedy tiny model's text: with them, stop strings end some turns.
STOP_STRINGS = ("e", "T")


@pytest.mark.parametrize(
    "max_turns, stop_strings",
    [(None, ()), (2, ()), pytest.param(None, STOP_STRINGS, marks=pytest.mark.slow)],
)
def test_greedy_episodes_equal_regenerating_each_turn(
    policy: PolicyModel,
    prompts: list[list[int]],
    stops: list[int],
    max_turns: int | None,
    stop_strings: tuple[str, ...],
) -> None:
    """The reference (:func:`generate` on the whole history, each turn) ends a turn at a stop
    string as a single response ends: the same episodes, context tokens never ending a turn."""
    calls: list[tuple[int, list[int]]] = []
    turns = [0] * len(prompts)
    decode = _decode(policy)

    def continue_fn(row: int, turn_tokens: list[int]) -> list[int] | None:
        calls.append((row, turn_tokens))
        by_string = any(s in decode(turn_tokens) for s in stop_strings)
        assert turn_tokens[-1] in stops or by_string
        turns[row] += 1
        return _context(row, turns[row] - 1)

    out = generate_turns(
        policy,
        prompts,
        continue_fn=continue_fn,
        max_new_tokens=MAX_NEW,
        temperature=0,
        stop_token_ids=stops,
        pad_token_id=PAD,
        max_turns=max_turns,
        stop_strings=stop_strings,
        decode=decode,
    )
    assert out.action_mask is not None and out.logprobs is not None and out.turn_spans
    lengths = np.array(out.lengths)
    multi = 0
    for row, prompt in enumerate(prompts):
        tokens, action, logprobs = _reference(policy, prompt, row, stops, max_turns, stop_strings)
        n = int(lengths[row])
        assert np.array(out.responses)[row, :n].tolist() == tokens, row
        assert np.array(out.action_mask)[row, :n].tolist() == action
        assert not np.array(out.action_mask)[row, n:].any()
        np.testing.assert_allclose(np.array(out.logprobs)[row, :n], logprobs, atol=2e-4)
        # Turn spans cover exactly the policy's tokens, in order.
        spans = out.turn_spans[row]
        covered = [t for start, end in spans for t in range(start, end)]
        assert covered == [t for t in range(n) if action[t]]
        multi += len(spans) > 1
    assert multi >= 2, "the test needs episodes of several turns"
    if stop_strings:  # some turns ended at a stop string, and the flags say which last turn did
        assert any(turn[-1] not in stops for _, turn in calls)
        assert out.stopped_by_string is not None
        for row, spans in enumerate(out.turn_spans):
            last = np.array(out.responses)[row, spans[-1][0] : spans[-1][1]].tolist()
            string = last[-1] not in stops and any(s in decode(last) for s in stop_strings)
            assert bool(out.stopped_by_string[row].item()) == string, row
    else:
        assert out.stopped_by_string is None
    if max_turns is None:
        assert len({len(s) for s in out.turn_spans}) > 1, "episodes should end at different turns"


def test_turn_ends_and_errors(policy: PolicyModel, prompts: list[list[int]]) -> None:
    assert np.array(turn_ends([[(0, 3), (5, 9)], [(0, 2)]])).tolist() == [[2, 8], [1, -1]]
    with pytest.raises(ValueError, match="return None to end"):
        generate_turns(
            policy,
            prompts[:1],
            continue_fn=lambda row, toks: [],
            max_new_tokens=8,
            temperature=0,
            stop_token_ids=list(range(512)),
            pad_token_id=PAD,
        )


def test_sampling_with_keys_does_not_depend_on_other_rows(
    policy: PolicyModel, prompts: list[list[int]], stops: list[int]
) -> None:
    keys = mx.random.split(mx.random.key(3), len(prompts))

    def run(rows: list[int]) -> np.ndarray:
        out = generate_turns(
            policy,
            [prompts[r] for r in rows],
            continue_fn=lambda i, toks: [30 + rows[i], 31] if len(toks) < 30 else None,
            max_new_tokens=24,
            temperature=1.0,
            stop_token_ids=stops,
            pad_token_id=PAD,
            keys=keys[mx.array(rows)],
        )
        return np.array(out.responses)[:, : int(np.array(out.lengths).min())]

    both = run([0, 1, 2, 3])
    alone = run([2])
    n = alone.shape[1]
    assert both[2, :n].tolist() == alone[0, :n].tolist()


def test_one_episode_alone_prefills_its_context_as_a_chunk(
    policy: PolicyModel, prompts: list[list[int]], stops: list[int]
) -> None:
    """With one live row every context run is fed as one (1, k) chunk: the same episode."""
    turns = [0]

    def continue_fn(row: int, turn_tokens: list[int]) -> list[int] | None:
        turns[0] += 1
        return _context(2, turns[0] - 1)

    out = generate_turns(
        policy,
        [prompts[2]],
        continue_fn=continue_fn,
        max_new_tokens=MAX_NEW,
        temperature=0,
        stop_token_ids=stops,
        pad_token_id=PAD,
    )
    tokens, action, _ = _reference(policy, prompts[2], 2, stops, None)
    assert 0 in action
    assert np.array(out.responses)[0].tolist() == tokens


def test_a_stop_token_that_completes_a_stop_string_counts_as_the_string_in_both(
    policy: PolicyModel, prompts: list[list[int]], stops: list[int]
) -> None:
    """Where a row's last token is a stop token whose text completes a stop string, a single
    response and a one-turn episode both say the string ended it (its text is then kept)."""
    # Every token decodes to "x" but the stop tokens, which decode to the stop string "|".
    decode = lambda ids: "".join("|" if t in stops else "x" for t in ids)  # noqa: E731
    common = dict(
        max_new_tokens=12,
        temperature=0.9,
        stop_token_ids=stops,
        pad_token_id=PAD,
        keys=mx.random.split(mx.random.key(3), len(prompts)),
        stop_strings=("|",),
        decode=decode,
    )
    single = generate(policy, prompts, **common)  # type: ignore[arg-type]
    episodes = generate_turns(
        policy, prompts, continue_fn=lambda i, toks: None, **common  # type: ignore[arg-type]
    )
    ended = np.array(single.ended_with_stop).tolist()
    assert any(ended), "no row sampled the stop token: pick another seed"
    assert single.stopped_by_string is not None and episodes.stopped_by_string is not None
    assert np.array(single.stopped_by_string).tolist() == ended
    assert np.array(episodes.stopped_by_string).tolist() == ended


@pytest.mark.parametrize("stop_strings", [(), STOP_STRINGS])
def test_one_turn_episodes_are_single_responses_bit_for_bit(
    policy: PolicyModel, prompts: list[list[int]], stops: list[int], stop_strings: Sequence[str]
) -> None:
    """Episodes that end after their first turn are :func:`generate`'s sampled responses: one
    decoding loop, the same PRNG key per row and column, the same log-probs and entropies."""
    keys = mx.random.split(mx.random.key(5), len(prompts))
    common = dict(
        max_new_tokens=12,
        temperature=0.9,
        top_p=0.95,
        top_k=50,
        stop_token_ids=stops,
        pad_token_id=PAD,
        keys=keys,
        stop_strings=stop_strings,
        decode=_decode(policy),
    )
    single = generate(policy, prompts, return_logprobs=True, **common)  # type: ignore[arg-type]
    episodes = generate_turns(
        policy, prompts, continue_fn=lambda i, toks: None, **common  # type: ignore[arg-type]
    )
    lengths = np.array(single.lengths)
    assert np.array(episodes.lengths).tolist() == lengths.tolist()
    assert lengths.min() < 12 and lengths.max() > 1  # some rows stop, some run on
    assert np.array(episodes.ended_with_stop).tolist() == np.array(single.ended_with_stop).tolist()
    assert single.logprobs is not None and single.entropy is not None
    assert episodes.logprobs is not None and episodes.entropy is not None
    width = int(lengths.max())
    for b, n in enumerate(lengths.tolist()):
        for name in ("responses", "logprobs", "entropy"):
            ours = np.array(getattr(episodes, name))[b, :n]
            theirs = np.array(getattr(single, name))[b, :n]
            assert ours.tobytes() == theirs.tobytes(), (name, b)
    assert np.array(episodes.responses).shape[1] == width
    if stop_strings:
        # One rule for both: a last token that is a stop token and also completes a stop
        # string counts as the stop string's.
        assert episodes.stopped_by_string is not None and single.stopped_by_string is not None
        ours = np.array(episodes.stopped_by_string).tolist()
        assert ours == np.array(single.stopped_by_string).tolist()
        responses = np.array(single.responses)
        by_token = [int(responses[b, n - 1]) in stops for b, n in enumerate(lengths.tolist())]
        assert any(o for o, token in zip(ours, by_token) if not token)
