"""Local LLM judges as rewards: a local checkpoint scores each completion, and the score is read
from the judge's own next-token probabilities, never parsed from free text.

The judge sees a prompt built from a template (the request, the response, and the question) in
its chat template with a generation prompt, and its reply would be the score: ``"0"`` ...
``"10"`` on the ``0-10`` scale, ``"yes"`` / ``"no"`` on the ``yes/no`` scale. Instead of sampling
that reply, one forward pass gives the probability of each candidate reply
(:func:`answer_probabilities`) and the reward is the expected score over them, divided by the
scale's top (a number in [0, 1]): ``sum_k P(k) value_k / sum_k P(k)``. A candidate reply of two
tokens (``"10"`` where digits are single tokens) is scored with its first token forced after the
prompt in the same pass.

* ``judge``: each completion on its own (pointwise).
* ``group_judge``: the completions of one prompt (a GRPO group: consecutive completions with the
  same prompt) shown together, and each scored against the others (ART's RULER idea), so the
  judge's scale adapts to what the group offers.

Both take ``model`` (a local checkpoint folder; 4-bit allowed), load it once per process, frozen,
and score in batches of ``batch_size`` prompts. ``{prompt}`` in a template is the prompt text as
the trainer formats it for the policy.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import numpy as np

from base_setup.tokenizer_setup import apply_chat_template, encode_text
from rewards.registry import register_reward

#: The candidate replies of each scale and the value each stands for (variants add up).
SCALES: dict[str, dict[str, float]] = {
    "0-10": {str(k): float(k) for k in range(11)},
    "yes/no": {"yes": 1.0, "Yes": 1.0, "no": 0.0, "No": 0.0},
}
#: The question that ends a judge's prompt, per scale.
QUESTIONS: dict[str, str] = {
    "0-10": "Answer with one number from 0 (useless) to 10 (perfect), and nothing else.",
    "yes/no": "Answer with yes or no, and nothing else.",
}
JUDGE_TEMPLATE = (
    "Rate the response to the request below: is it correct, helpful and to the point?\n\n"
    "Request:\n{prompt}\n\nResponse:\n{completion}\n\n{question}"
)
GROUP_TEMPLATE = (
    "Several responses to one request follow. Compare them: which are correct, helpful and to "
    "the point?\n\nRequest:\n{prompt}\n\n{responses}\n\nHow good is response {index}, compared "
    "with the others? {question}"
)


@dataclass(frozen=True)
class Candidates:
    """A scale's candidate replies as token ids for one judge tokenizer.

    Attributes:
        ids: each candidate's token ids (one or two).
        values: each candidate's value.
        forced: the token forced after the prompt when a two-token candidate needs the second
            token's probability (the first token they share with a one-token candidate), else
            None.
    """

    ids: tuple[tuple[int, ...], ...]
    values: tuple[float, ...]
    forced: int | None


def candidates_for(tokenizer: Any, scale: str) -> Candidates:
    """The candidate replies of ``scale`` in ``tokenizer``'s ids.

    Raises:
        ValueError: an unknown scale, or candidates this reading cannot tell apart (two values
            with the same one-token reply, replies of three tokens or more, or two-token
            replies whose first tokens differ).
    """
    if scale not in SCALES:
        raise ValueError(f"judge scale must be one of {sorted(SCALES)}, got {scale!r}")
    ids: list[tuple[int, ...]] = []
    values: list[float] = []
    for text, value in SCALES[scale].items():
        tokens = tuple(int(t) for t in tokenizer.encode(text, add_special_tokens=False))
        if not tokens:
            raise ValueError(f"the judge's tokenizer encodes {text!r} as no tokens")
        if tokens in ids:  # "Yes" and "yes" may be one token: count it once
            if values[ids.index(tokens)] != value:
                raise ValueError(f"the judge's tokenizer gives two scores the ids {tokens}")
            continue
        ids.append(tokens)
        values.append(value)
    firsts: dict[int, list[int]] = {}
    for k, tokens in enumerate(ids):
        firsts.setdefault(tokens[0], []).append(k)
    shared = [t for t, ks in firsts.items() if len({values[k] for k in ks}) > 1]
    forced = None
    if shared:
        if len(shared) > 1 or any(len(ids[k]) > 2 for k in firsts[shared[0]]):
            raise ValueError(
                f"the judge's tokenizer splits the {scale} replies so that they share first "
                f"tokens ({[ids[k] for t in shared for k in firsts[t]]}); this reading tells "
                "apart replies that differ in their first token, or one shared first token and "
                "a second: use the other scale or another judge"
            )
        forced = shared[0]
    # Two-token candidates whose first token is no one's prefix are read from that token alone.
    trimmed = tuple(t if (forced is not None and t[0] == forced) else t[:1] for t in ids)
    return Candidates(trimmed, tuple(values), forced)


def answer_probabilities(
    first: np.ndarray, second: np.ndarray | None, candidates: Candidates
) -> np.ndarray:
    """Probability of each candidate reply, shape (B, K).

    ``P(c) = p1[c_0]`` for a candidate read from its first token, ``p1[f] p2[c_1]`` for a
    two-token one starting with the forced token ``f``, and ``p1[f] (1 - sum_u p2[u])`` for the
    one-token candidate ``f`` (``u`` the second tokens of the two-token ones: ``"1"`` is ``"1"``
    not followed by ``"0"``).

    Args:
        first: (B, V) next-token probabilities after the prompt.
        second: (B, V) after the prompt and the forced token (None when nothing is forced).
        candidates: from :func:`candidates_for`.
    """
    out = np.zeros((first.shape[0], len(candidates.ids)), dtype=np.float64)
    seconds = [c[1] for c in candidates.ids if len(c) == 2]
    for k, tokens in enumerate(candidates.ids):
        p = first[:, tokens[0]].astype(np.float64)
        if len(tokens) == 2:
            assert second is not None
            p = p * second[:, tokens[1]]
        elif candidates.forced is not None and tokens[0] == candidates.forced:
            assert second is not None
            p = p * (1.0 - second[:, seconds].astype(np.float64).sum(axis=1))
        out[:, k] = p
    return out


def expected_scores(probabilities: np.ndarray, values: Sequence[float]) -> np.ndarray:
    """``sum_k P(k) v_k / sum_k P(k)`` per row divided by the top value: (B,) in [0, 1]."""
    v = np.asarray(values, dtype=np.float64)
    mass = probabilities.sum(axis=1)
    return (probabilities @ v) / np.maximum(mass, 1e-30) / v.max()


@lru_cache(maxsize=2)
def load_judge(path: str) -> Any:
    """The judge at ``path`` as a frozen model (:class:`models.sft_model.ReferenceModel`),
    loaded once per process."""
    from models.sft_model import ReferenceModel

    return ReferenceModel.from_pretrained(path)


def judge_prompt_ids(tokenizer: Any, text: str) -> list[int]:
    """The judge's prompt: ``text`` as a user message in its chat template with a generation
    prompt, or the text and ``"\\nAnswer: "`` for a judge without a template."""
    if getattr(tokenizer, "chat_template", None):
        return apply_chat_template(tokenizer, [{"role": "user", "content": text}])
    return encode_text(tokenizer, text + "\nAnswer: ")


def score_texts(model: Any, texts: Sequence[str], scale: str, batch_size: int) -> list[float]:
    """The judge's expected score of each prompt text, in batches of ``batch_size``."""
    probabilities, candidates = judge_probabilities(model, texts, scale, batch_size)
    return list(expected_scores(probabilities, candidates.values).tolist())


def judge_probabilities(
    model: Any, texts: Sequence[str], scale: str, batch_size: int
) -> tuple[np.ndarray, Candidates]:
    """The probability of each candidate reply of ``scale`` after each prompt text, (B, K),
    and the candidates, in batches of ``batch_size``."""
    import mlx.core as mx  # here: listing the rewards loads no MLX

    tokenizer = model.tokenizer
    candidates = candidates_for(tokenizer, scale)
    out: list[np.ndarray] = []
    for start in range(0, len(texts), batch_size):
        rows = [judge_prompt_ids(tokenizer, t) for t in texts[start : start + batch_size]]
        lengths = np.array([len(r) for r in rows])
        extra = [] if candidates.forced is None else [candidates.forced]
        width = int(lengths.max()) + len(extra)
        pad = int(tokenizer.pad_token_id or 0)
        ids = np.full((len(rows), width), pad, dtype=np.int32)  # right-padded: causal attention
        for i, r in enumerate(rows):
            ids[i, : len(r) + len(extra)] = r + extra
        positions = (lengths - 1)[:, None] + np.arange(1 + len(extra))[None, :]  # (B, 1 or 2)
        logits = model.logits_at(mx.array(ids), mx.array(positions.astype(np.int32)))
        probs = np.asarray(mx.softmax(logits.astype(mx.float32), axis=-1))  # (B, 1 or 2, V)
        second = probs[:, 1] if extra else None
        out.append(answer_probabilities(probs[:, 0], second, candidates))
    empty = np.zeros((0, len(candidates.ids)))
    return (np.concatenate(out) if out else empty), candidates


def verdict_details(
    probabilities: np.ndarray, values: Sequence[float], scale: str
) -> dict[str, list[Any]]:
    """What a judge's scores were read from, per row of ``probabilities`` (B, K), as the rollout
    records keep them: ``score``, the expected reply on the scale (0-10, or P(yes) for yes/no);
    ``distribution``, each reply's probability among the scale's replies (``{"0": ..., "10":
    ...}`` or ``{"yes": ..., "no": ...}``, variants added up); ``mass``, the probability that
    the judge's reply is one of them at all (low: the judge would answer otherwise)."""
    v = np.asarray(values, dtype=np.float64)
    mass = probabilities.sum(axis=1)  # (B,)
    shares = probabilities / np.maximum(mass, 1e-30)[:, None]  # (B, K)
    names = {1.0: "yes", 0.0: "no"} if scale == "yes/no" else {x: str(int(x)) for x in set(v)}
    order = sorted(set(v.tolist()), reverse=scale == "yes/no")
    distribution = [
        {names[x]: float(shares[b, v == x].sum()) for x in order} for b in range(len(shares))
    ]
    return {
        "score": (shares @ v).tolist(),
        "distribution": distribution,
        "mass": mass.tolist(),
    }


def _judged(
    texts: Sequence[str],
    model: str,
    scale: str,
    batch_size: int,
    log_extra: Callable[[str, Sequence[Any]], None] | None,
    shown_prompts: Sequence[str | None] | None = None,
) -> list[float | None]:
    """The judge's rewards of ``texts`` (scores / top value), and, with ``log_extra``, its
    prompts (``shown_prompts`` where given) and :func:`verdict_details` for the records."""
    probabilities, candidates = judge_probabilities(load_judge(model), texts, scale, batch_size)
    if log_extra is not None:
        log_extra("prompt", list(texts if shown_prompts is None else shown_prompts))
        for column, values in verdict_details(probabilities, candidates.values, scale).items():
            log_extra(column, values)
    return list(expected_scores(probabilities, candidates.values).tolist())


def _check(name: str, scale: str, batch_size: int) -> None:
    if scale not in SCALES:
        raise ValueError(f"{name}: scale must be one of {sorted(SCALES)}, got {scale!r}")
    if batch_size < 1:
        raise ValueError(f"{name}: batch_size must be >= 1, got {batch_size}")


@register_reward("judge")
def judge(
    prompts: list[str],
    completions: list[str],
    *,
    model: str,
    scale: str = "0-10",
    template: str = JUDGE_TEMPLATE,
    batch_size: int = 8,
    log_extra: Callable[[str, Sequence[Any]], None] | None = None,
    **_: Any,
) -> list[float | None]:
    """A local LLM judge's score of each completion, read from its own probabilities (0-1).

    ``model``: the judge's checkpoint folder; ``scale``: ``"0-10"`` or ``"yes/no"``;
    ``template``: its prompt, with ``{prompt}``, ``{completion}`` and ``{question}`` (the
    scale's question). The score is the judge's expected reply over the scale's candidates
    divided by the top value. ``log_extra`` (the trainer's, TRL's): it logs each completion's
    ``prompt`` (the template filled in, before the judge's chat template) and
    :func:`verdict_details` for the rollout records.
    """
    _check("judge", scale, batch_size)
    texts = [
        template.format(prompt=p, completion=c, question=QUESTIONS[scale])
        for p, c in zip(prompts, completions, strict=True)
    ]
    return _judged(texts, model, scale, batch_size, log_extra)


def prompt_groups(prompts: Sequence[str]) -> list[range]:
    """Runs of consecutive equal prompts (a GRPO group's completions), as index ranges."""
    groups: list[range] = []
    start = 0
    for i in range(1, len(prompts) + 1):
        if i == len(prompts) or prompts[i] != prompts[start]:
            groups.append(range(start, i))
            start = i
    return groups


@register_reward("group_judge")
def group_judge(
    prompts: list[str],
    completions: list[str],
    *,
    model: str,
    scale: str = "0-10",
    template: str = GROUP_TEMPLATE,
    batch_size: int = 8,
    log_extra: Callable[[str, Sequence[Any]], None] | None = None,
    **_: Any,
) -> list[float | None]:
    """A local LLM judge's score of each completion against the others of its group (0-1).

    The group is the run of consecutive completions of the same prompt (GRPO's group). The
    judge sees them all (``Response 1: ...``) and scores each in turn; ``template`` has
    ``{prompt}``, ``{responses}``, ``{index}`` and ``{question}``. ``log_extra``: as
    :func:`judge`'s, plus each completion's ``response`` number in its group; the prompt,
    which holds the whole group, is logged once, on the group's first completion (None on
    the others: theirs differs only in the number asked about).
    """
    _check("group_judge", scale, batch_size)
    if len(prompts) != len(completions):
        raise ValueError(f"group_judge: {len(prompts)} prompts for {len(completions)} completions")
    texts: list[str] = []
    numbers: list[int] = []
    for group in prompt_groups(prompts):
        shown = "\n\n".join(
            f"Response {n}:\n{completions[i]}" for n, i in enumerate(group, start=1)
        )
        for n in range(1, len(group) + 1):
            texts.append(
                template.format(
                    prompt=prompts[group[0]],
                    responses=shown,
                    index=n,
                    question=QUESTIONS[scale],
                )
            )
            numbers.append(n)
    if log_extra is not None:
        log_extra("response", numbers)
    logged = [t if n == 1 else None for t, n in zip(texts, numbers)]
    return _judged(texts, model, scale, batch_size, log_extra, logged)
