"""The demo's bundled data, built deterministically from :mod:`models.tiny_corpus` (nothing is
downloaded, nothing large is committed).

* SFT data: reviews of mixed sentiment as ``{"prompt": "Review of the laptop:", "completion":
  " The screen is superb."}``; supervised fine-tuning on it teaches the tiny model to write
  reviews.
* Preference data: ``{"prompt", "chosen", "rejected"}`` where both answers review the same item
  and ``chosen`` is the more positive one (positive over neutral over negative), so
  ``lexicon_score(chosen) > lexicon_score(rejected)`` for every pair: a preference anyone can
  check, and one a reward model learns quickly (positive words good, negative words bad). PPO
  against that reward model then makes the policy's reviews more positive.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Iterable, Mapping

from models.tiny_corpus import Review, Sentiment, review_corpus

# Pair kinds (chosen sentiment, rejected sentiment), drawn in turn.
_PAIR_KINDS: tuple[tuple[Sentiment, Sentiment], ...] = (
    ("positive", "negative"),
    ("positive", "neutral"),
    ("neutral", "negative"),
)


def sft_records(n: int, seed: int = 0) -> list[dict[str, str]]:
    """``n`` prompt/completion records: the reviews of ``review_corpus(n, seed)`` (a third of
    each sentiment), split at the colon after the item."""
    return [{"prompt": r.prompt, "completion": r.completion} for r in review_corpus(n, seed)]


def preference_records(n: int, seed: int = 0) -> list[dict[str, str]]:
    """``n`` distinct preference pairs; in each, two reviews of the same item, ``chosen`` the
    more positive (a third each of positive/negative, positive/neutral, neutral/negative, in
    turn). Deterministic in ``(n, seed)``.

    Raises:
        ValueError: ``n`` is not positive.
    """
    if n <= 0:
        raise ValueError(f"n must be a positive number of pairs, got {n}")
    pool = review_corpus(max(3 * n, 600), seed=seed)
    by_prompt: dict[tuple[str, Sentiment], list[Review]] = {}
    for review in pool:
        by_prompt.setdefault((review.prompt, review.sentiment), []).append(review)
    prompts = sorted({r.prompt for r in pool})
    rng = random.Random(seed)
    seen: set[tuple[str, str]] = set()
    records: list[dict[str, str]] = []
    attempts = 0
    while len(records) < n:
        attempts += 1
        if attempts > 50 * n + 1000:
            raise ValueError(f"could not draw {n} distinct pairs (got {len(records)}); ask fewer")
        good, bad = _PAIR_KINDS[len(records) % len(_PAIR_KINDS)]
        prompt = rng.choice(prompts)
        if (prompt, good) not in by_prompt or (prompt, bad) not in by_prompt:
            continue
        chosen = rng.choice(by_prompt[prompt, good])
        rejected = rng.choice(by_prompt[prompt, bad])
        if (chosen.text, rejected.text) in seen:
            continue
        seen.add((chosen.text, rejected.text))
        records.append(
            {"prompt": prompt, "chosen": chosen.completion, "rejected": rejected.completion}
        )
    return records


def write_jsonl(path: str | Path, records: Iterable[Mapping[str, object]]) -> Path:
    """Write records as JSON Lines (UTF-8, one object per line); creates parent directories."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as f:
        for record in records:
            f.write(json.dumps(record, ensure_ascii=False) + "\n")
    return path


def write_sft_data(path: str | Path, n: int, seed: int = 0) -> Path:
    """Write :func:`sft_records` ``(n, seed)`` as JSONL to ``path``; returns the path."""
    return write_jsonl(path, sft_records(n, seed))


def write_preference_data(path: str | Path, n: int, seed: int = 0) -> Path:
    """Write :func:`preference_records` ``(n, seed)`` as JSONL to ``path``; returns the path."""
    return write_jsonl(path, preference_records(n, seed))
