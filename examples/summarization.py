"""Summarization with PPO: ``Summarize: <article>\\nTL;DR:`` prompts, rewarded for faithful, concise
summaries.

The reward of a summary ``y`` of an article with reference summaries ``refs`` is

    score(y) = quality(y) - length_penalty * min(1, max(0, words(y) - max_length_ratio * L) / L)

where ``L = max(words(ref) for ref in refs)`` and ``quality`` is

* the trained reward model named by ``reward_model_name`` (a ``*ForSequenceClassification``
  checkpoint that scores the prompt + summary tokens), if the config names one;
* else :func:`rouge_quality`: the mean of the ROUGE-1, ROUGE-2 and ROUGE-L F1 of ``y`` against
  its best-matching reference (``rouge-score``, Porter stemming), in [0, 1].

Overlap with a reference rewards saying what the article says (faithfulness, in the limited sense
ROUGE can measure); the F1's precision and the length term penalise padding.

Data: JSONL records ``{"article": ..., "summary": ...}`` (the bundled ``data/summarization.jsonl``,
36 short news stories written for this project), or a Hub dataset whose columns are one of
:data:`FIELD_PAIRS` (XSum's document/summary, CNN/DailyMail's article/highlights, SAMSum's
dialogue/summary); ``summary`` may also be a list of references. :func:`summary_record` turns a
row into the prompt record the trainer trains on: ``{"prompt": article, "references": [...]}``.

Run: ``python -m examples.summarization`` (offline: the embedded tiny model, first fine-tuned on
the training articles' reference summaries, :func:`summary_sft_record`), or
``--model <dir or repo id>`` for a real one.
"""

from __future__ import annotations

if __name__ == "__main__":  # run as a script: MLX's fast BLAS before anything imports mlx
    from base_setup import setup_blas

    setup_blas()

import functools
import logging
import sys
from typing import Any, Mapping, Sequence, cast

import mlx.core as mx
import numpy as np

from config.ppo_config import PPOConfig
from examples.task_common import DATA_DIR, run_task_cli, task_argument_parser
from finetune.records import require_object
from ppo_trainer.ppo_trainer import PPOTrainer
from ppo_trainer.prompt_records import Prompt, PromptInput, split_records

logger = logging.getLogger("ppo_mlx")

BUNDLED_DATA = DATA_DIR / "summarization.jsonl"
PROMPT_TEMPLATE = "Summarize: {article}\nTL;DR:"

#: (article column, summary column) pairs recognised in a dataset, first match wins.
FIELD_PAIRS: tuple[tuple[str, str], ...] = (
    ("article", "summary"),
    ("document", "summary"),
    ("article", "highlights"),
    ("dialogue", "summary"),
    ("text", "summary"),
)

#: PPO settings of the command line (overridable with --set or --config).
TASK_DEFAULTS: dict[str, Any] = dict(
    max_new_tokens=32,
    batch_size=4,
    learning_rate=1e-4,
    num_ppo_epochs=2,
    num_mini_batches=2,
    kl_coef=0.05,
    temperature=0.7,
    total_steps=20,
)
#: SFT of the embedded tiny model (no --model) on the reference summaries, before PPO: enough to
#: do the task a little on the training prompts, and short enough to leave room for the RL stage:
#: at 35 steps some seeds already copy the references' first 32 tokens (ROUGE ~0.64 of the ~0.68
#: that 32 tokens allow), and nothing is left to learn.
SFT_SETTINGS: dict[str, Any] = dict(
    learning_rate=3e-3, batch_size=8, total_steps=27, warmup_steps=2, progress_bar=True
)
#: RL settings of the embedded tiny model's run (over TASK_DEFAULTS): GRPO, whose baseline is the
#: mean score of 4 summaries of the same article, so that an advantage says which summary of an
#: article is better rather than which article is easy (PPO's value head starts untrained). The
#: evaluations sample at the training temperature, as the rollouts do.
TINY_DEFAULTS: dict[str, Any] = dict(
    algorithm="grpo",
    group_size=4,
    max_new_tokens=32,
    batch_size=4,
    learning_rate=1e-3,
    total_steps=40,
    eval_temperature=0.7,
)
#: Samples of each prompt in the evaluations before and after RL (4 rather than the shared 2: a
#: standard error of the change of the mean reward sqrt(2) times smaller).
EVAL_SAMPLES_PER_PROMPT = 4


# --------------------------------------------------------------------------- the reward


@functools.lru_cache(maxsize=1)
def _rouge_scorer() -> Any:
    try:
        from rouge_score import rouge_scorer
    except ImportError as err:
        raise ImportError(
            "the summarization reward needs rouge-score: pip install rouge-score"
        ) from err
    logging.getLogger("absl").setLevel(logging.WARNING)  # "Using default tokenizer." at INFO
    return rouge_scorer.RougeScorer(["rouge1", "rouge2", "rougeL"], use_stemmer=True)


def rouge_quality(summary: str, references: Sequence[str]) -> float:
    """Mean of the ROUGE-1, ROUGE-2 and ROUGE-L F1 of ``summary`` against ``references``.

    ``(F1_rouge1 + F1_rouge2 + F1_rougeL) / 3``, each F1 the best over the references
    (``rouge_score.RougeScorer.score_multi``; lower-cased words, Porter-stemmed). In [0, 1]: 1 for
    a summary equal to a reference, 0 for one sharing no word with any (or empty).
    """
    if not references:
        raise ValueError("rouge_quality needs at least one reference summary")
    scores = _rouge_scorer().score_multi(list(references), summary)
    return float(np.mean([scores[k].fmeasure for k in ("rouge1", "rouge2", "rougeL")]))


def rouge_reward(
    prompts: list[str], completions: list[str], references: list[Sequence[str]]
) -> list[float]:
    """:func:`rouge_quality` of each completion against its prompt record's references (the
    quality reward when the config names no reward model)."""
    return [rouge_quality(c, refs) for c, refs in zip(completions, references)]


def length_penalty(
    summary: str, references: Sequence[str], *, max_length_ratio: float, coef: float
) -> float:
    """``coef * min(1, max(0, words(summary) - max_length_ratio * L) / L)``, ``L`` the longest
    reference's word count: zero up to the length budget, then linear in the excess words
    (relative to L), capped at ``coef`` so that one rambling sample cannot dominate the batch's
    rewards (quality is in [0, 1])."""
    longest = max(len(r.split()) for r in references)
    if longest == 0:
        raise ValueError("length_penalty needs a non-empty reference summary")
    excess = max(0.0, len(summary.split()) - max_length_ratio * longest)
    return coef * min(1.0, excess / longest)


# --------------------------------------------------------------------------- the data


def _fields(record: Mapping[str, Any], where: str) -> tuple[str, str]:
    for article, summary in FIELD_PAIRS:
        if article in record and summary in record:
            return article, summary
    pairs = ", ".join(f"{a}/{s}" for a, s in FIELD_PAIRS)
    raise ValueError(
        f"{where}: expected an article and its summary as one of the column pairs {pairs}; "
        f"found columns {sorted(record)}"
    )


def summary_record(record: Any, where: str) -> dict[str, Any]:
    """The prompt record ``{"prompt": article, "references": [summary, ...]}`` of a row with a
    non-empty article and a non-empty summary (a string, or a non-empty list of strings) under
    one of :data:`FIELD_PAIRS`.

    Raises:
        ValueError: ``"<where>: ..."`` for a malformed row.
    """
    record = require_object(record, where, "an article and its summary")
    article_key, summary_key = _fields(record, where)
    article, summary = record[article_key], record[summary_key]
    if not isinstance(article, str) or not article.strip():
        raise ValueError(f"{where}: {article_key!r} must be a non-empty string")
    refs = [summary] if isinstance(summary, str) else summary
    if (
        not isinstance(refs, list)
        or not refs
        or not all(isinstance(r, str) and r.strip() for r in refs)
    ):
        raise ValueError(
            f"{where}: {summary_key!r} must be a non-empty string or a list of them, got "
            f"{summary!r:.60}"
        )
    return {"prompt": article.strip(), "references": [r.strip() for r in refs]}


def summary_sft_record(record: Mapping[str, Any]) -> dict[str, Any]:
    """The SFT record of a prompt record: the TL;DR prompt, completed by its first reference."""
    prompt = PROMPT_TEMPLATE.format(article=record["prompt"])
    return {"prompt": prompt, "completion": " " + record["references"][0]}


def _references(columns: Mapping[str, Any]) -> list[Sequence[str]]:
    if "references" not in columns:
        raise ValueError(
            "SummarizationTrainer scores summaries against references: train on prompt records "
            '{"prompt": article, "references": [summary, ...]} (see summary_record)'
        )
    return list(columns["references"])


# --------------------------------------------------------------------------- the trainer


class SummarizationTrainer(PPOTrainer):
    """PPO on article -> summary prompts, rewarded for faithful, concise summaries.

    Trains on prompt records ``{"prompt": article, "references": [...]}`` (:func:`summary_record`).
    Overrides :meth:`format_prompt` (the TL;DR prompt, the article's tail cut to fit
    ``max_prompt_length``), :meth:`compute_scores` (the length penalty on top of the reward
    model's or ROUGE's quality) and :meth:`evaluate` (adds ROUGE and summary length).

    Args:
        config: the run configuration; ``reward_model_name`` set = quality from that reward
            model, else ROUGE against the references (:func:`rouge_reward`).
        length_penalty: ``coef`` of :func:`length_penalty` (0 = no penalty).
        max_length_ratio: summaries up to this many times the longest reference's word count go
            unpenalised.
        **components: ``policy``, ``ref_model``, ``reward_model``, ``value_model``,
            ``tokenizer``, as for :class:`PPOTrainer`; a ``reward_model`` (a reward model or a
            function) replaces ROUGE as the quality.
    """

    def __init__(
        self,
        config: PPOConfig,
        *,
        length_penalty: float = 1.0,
        max_length_ratio: float = 1.5,
        **components: Any,
    ) -> None:
        if length_penalty < 0 or max_length_ratio <= 0:
            raise ValueError(
                f"length_penalty must be >= 0 and max_length_ratio > 0, got {length_penalty} "
                f"and {max_length_ratio}"
            )
        self.length_penalty = length_penalty
        self.max_length_ratio = max_length_ratio
        if components.get("reward_model") is None and config.reward_model_name is None:
            components["reward_model"] = rouge_reward
        super().__init__(config, **components)

    def format_prompt(self, prompt: Prompt) -> str:
        """``Summarize: <article>\\nTL;DR:``; an article too long for ``max_prompt_length`` keeps
        its beginning (news puts the essentials first)."""
        if not isinstance(prompt, str):
            raise ValueError("SummarizationTrainer prompts are article texts, not chat messages")
        text = PROMPT_TEMPLATE.format(article=prompt)
        limit = self.config.max_prompt_length
        excess = len(self.encode_prompt(text)) - limit
        if excess <= 0:
            return text
        article_ids = self.encode_prompt(prompt)
        keep = len(article_ids) - excess
        while keep > 0:
            text = PROMPT_TEMPLATE.format(article=self.decode_completion(article_ids[:keep]))
            excess = len(self.encode_prompt(text)) - limit
            if excess <= 0:
                return text
            keep -= excess  # re-tokenising at the cut can add a token or two
        raise ValueError(
            f"max_prompt_length={limit} leaves no room for the article after the prompt template "
            f"{PROMPT_TEMPLATE!r}: raise max_prompt_length"
        )

    def compute_scores(
        self,
        prompts: list[str],
        completions: list[str],
        query_responses: mx.array,
        sequence_lengths: mx.array,
        **columns: Any,
    ) -> tuple[mx.array, dict[str, mx.array]]:
        """Quality (reward model or ROUGE, via :meth:`PPOTrainer.compute_scores`) minus the
        length penalty against the ``references`` column, shape (B,), and the quality's metrics
        with the mean penalty (``rewards/length_penalty``)."""
        references = _references(columns)
        # The default returns (scores, metrics); overrides may return the scores alone.
        quality, metrics = cast(
            tuple[mx.array, dict[str, mx.array]],
            super().compute_scores(
                prompts, completions, query_responses, sequence_lengths, **columns
            ),
        )
        penalties = mx.array(
            [self._penalty(c, refs) for c, refs in zip(completions, references)], dtype=mx.float32
        )  # (B,)
        metrics = {**metrics, "rewards/length_penalty": penalties.mean()}
        return quality.astype(mx.float32) - penalties, metrics

    def _penalty(self, summary: str, references: Sequence[str]) -> float:
        return length_penalty(
            summary, references, max_length_ratio=self.max_length_ratio, coef=self.length_penalty
        )

    def evaluate(
        self,
        prompts: Sequence[PromptInput],
        max_new_tokens: int | None = None,
        temperature: float | None = None,
        num_samples: int = 4,
    ) -> dict[str, Any]:
        """:meth:`PPOTrainer.evaluate` plus ``eval/rouge`` (mean :func:`rouge_quality`),
        ``eval/length_penalty`` (mean :func:`length_penalty`) and ``eval/summary_words`` (mean
        words per summary). Without a reward model, ``eval/mean_reward`` is ``eval/rouge -
        eval/length_penalty``."""
        references = _references(split_records(prompts)[1])
        result = super().evaluate(prompts, max_new_tokens, temperature, num_samples=len(prompts))
        samples = result["samples"]
        pairs = [(s["completion"], refs) for s, refs in zip(samples, references)]
        result["eval/rouge"] = float(np.mean([rouge_quality(c, refs) for c, refs in pairs]))
        result["eval/length_penalty"] = float(
            np.mean([self._penalty(c, refs) for c, refs in pairs])
        )
        result["eval/summary_words"] = float(np.mean([len(c.split()) for c, _ in pairs]))
        result["samples"] = samples[:num_samples]
        return result


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m examples.summarization [--model DIR] [--steps N] ...``"""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    parser = task_argument_parser(__doc__.split("\n\n")[0], BUNDLED_DATA)
    parser.add_argument("--length-penalty", type=float, default=1.0, help="0 = no penalty")
    parser.add_argument(
        "--max-length-ratio",
        type=float,
        default=1.5,
        help="summary words allowed before the penalty, as a multiple of the reference's",
    )
    args = parser.parse_args(argv)
    return run_task_cli(
        args,
        to_record=summary_record,
        task_defaults=TASK_DEFAULTS,
        default_output_dir="runs/summarization",
        to_sft=summary_sft_record,
        sft_settings=SFT_SETTINGS,
        tiny_defaults=TINY_DEFAULTS,
        eval_samples_per_prompt=EVAL_SAMPLES_PER_PROMPT,
        build=lambda config: SummarizationTrainer(
            config, length_penalty=args.length_penalty, max_length_ratio=args.max_length_ratio
        ),
    )


if __name__ == "__main__":
    sys.exit(main())
