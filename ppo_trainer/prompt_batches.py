"""How a run's prompts become the sequences it generates from: each prompt (text, chat messages
or a record, :mod:`ppo_trainer.prompt_records`) formatted and encoded by the trainer's seams
(``format_prompt``, ``encode_prompt``), checked before any generation (the columns the reward
reads, the lengths), and repeated once per sample of its group.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import mlx.core as mx

from base_setup.tokenizer_setup import chat_template_text
from config.ppo_config import PPOConfig
from ppo_trainer.chat import has_chat_template
from ppo_trainer.gkd import split_completion, takes_data_completions
from ppo_trainer.prompt_records import (
    Columns,
    Prompt,
    PromptInput,
    repeat_columns,
    slice_columns,
    split_records,
)
from ppo_trainer.rollout import PromptBatch, check_prompts, rollout_keys
from ppo_trainer.scorer import Scorer

logger = logging.getLogger("ppo_mlx")


def chat_prompts(tokenizer: Any, setting: bool | str, log: bool = False) -> bool:
    """Whether plain-text prompts go through the chat template: ``config.use_chat_template``,
    ``"auto"`` meaning when the tokenizer has one (as ``mlx_lm.generate`` decides); ``log``:
    say which (a run whose trainer keeps the default ``format_prompt``).

    Raises:
        ValueError: ``use_chat_template`` is true and the tokenizer has no chat template.
    """
    has = has_chat_template(tokenizer)
    if setting is True and not has:
        raise ValueError(
            "use_chat_template is true but the tokenizer of model_name has no chat template: "
            "set use_chat_template to false (prompts as they are) or auto"
        )
    chat = has if setting == "auto" else bool(setting)
    if log:
        logger.info(
            "plain-text prompts %s (use_chat_template=%s)",
            (
                "go through the tokenizer's chat template"
                if chat
                else "are used as they are, without a chat template"
            ),
            str(setting).lower(),
        )
    return chat


def format_chat_prompt(
    prompt: Prompt,
    tokenizer: Any,
    chat: bool,
    system_prompt: str | None = None,
    template_kwargs: dict[str, Any] | None = None,
) -> str:
    """The default ``format_prompt``: chat messages go through the tokenizer's chat template
    with a generation prompt, ``system_prompt`` first when they have no system message and
    ``template_kwargs`` as the template's variables; text too, as one user message, when
    ``chat`` (:func:`chat_prompts`), else it is used as is."""
    if isinstance(prompt, str):
        if not chat:
            return prompt
        prompt = [{"role": "user", "content": prompt}]
    if system_prompt is not None and not (prompt and prompt[0].get("role") == "system"):
        prompt = [{"role": "system", "content": system_prompt}, *prompt]
    return chat_template_text(tokenizer, prompt, template_kwargs=template_kwargs)


@dataclass(frozen=True)
class PromptPreparation:
    """A run's prompts made sequences.

    Attributes:
        format_prompt: a prompt's text for the policy (the trainer's seam).
        encode_prompt: a formatted prompt's token ids (the trainer's seam).
        scorer: the run's scores, whose columns every prompt batch must carry.
        max_prompt_length: the longest prompt allowed, in tokens.
        max_new_tokens: the most tokens generated after a prompt, training's or evaluation's.
        context_length: the policy's context (None: unknown).
        group_size: samples per prompt, adjacent.
        batch_size: prompts per step, the global batch.
        seed: the run's seed (the PRNG keys of a step's sequences).
        rank, world_size: this process's place among the data-parallel ranks.
        split_completions: chat messages that end with the assistant's turn are a prompt and
            its completion (GKD's data: :func:`ppo_trainer.gkd.split_completion`).
    """

    format_prompt: Callable[[Prompt], str]
    encode_prompt: Callable[[str], list[int]]
    scorer: Scorer
    max_prompt_length: int
    max_new_tokens: int
    context_length: int | None
    group_size: int
    batch_size: int
    seed: int
    rank: int = 0
    world_size: int = 1
    split_completions: bool = False

    @classmethod
    def from_config(
        cls,
        config: PPOConfig,
        format_prompt: Callable[[Prompt], str],
        encode_prompt: Callable[[str], list[int]],
        scorer: Scorer,
        context_length: int | None,
        rank: int = 0,
        world_size: int = 1,
    ) -> PromptPreparation:
        """The preparation of a run with ``config`` and the trainer's seams."""
        return cls(
            format_prompt,
            encode_prompt,
            scorer,
            config.max_prompt_length,
            max(config.max_new_tokens, config.eval_tokens),
            context_length,
            config.group_size,
            config.batch_size,
            config.seed,
            rank,
            world_size,
            split_completions=takes_data_completions(config),
        )

    def prepare(
        self, prompts: Sequence[PromptInput], start: int, stop: int
    ) -> tuple[list[str], list[list[int]], Columns]:
        """Prompts ``start:stop`` formatted and encoded, with their columns, checked (columns
        the reward needs, lengths) before any generation."""
        if self.split_completions:
            prompts = [split_completion(p) for p in prompts]
        plain, all_columns = split_records(prompts)
        self.scorer.check_columns(all_columns)
        texts = [self.format_prompt(p) for p in plain[start:stop]]
        prompt_ids = [self.encode_prompt(t) for t in texts]
        check_prompts(
            prompt_ids,
            texts,
            max_prompt_length=self.max_prompt_length,
            max_new_tokens=self.max_new_tokens,
            context_length=self.context_length,
        )
        return texts, prompt_ids, slice_columns(all_columns, start, stop)

    def batch(
        self, prompts: Sequence[PromptInput], start: int = 0, stop: int | None = None
    ) -> PromptBatch:
        """Prompts ``start:stop`` (default: all) prepared, each repeated ``group_size`` times:
        a step's sequences."""
        stop = len(prompts) if stop is None else stop
        texts, prompt_ids, columns = self.prepare(prompts, start, stop)
        return PromptBatch(texts, prompt_ids, columns).repeat(self.group_size)

    def step_share(
        self, prompts: Sequence[PromptInput], global_step: int
    ) -> tuple[PromptBatch, mx.array]:
        """This rank's contiguous share of a step's global batch of ``prompts``, each
        ``group_size`` times, and their PRNG keys: sequence ``k`` of the global batch samples
        from key ``k`` of the step after ``global_step`` (:func:`rollout_keys`), so that the
        responses do not depend on the number of ranks."""
        if len(prompts) != self.batch_size:
            raise ValueError(
                f"step() needs batch_size={self.batch_size} prompts, got {len(prompts)}"
            )
        local = self.batch_size // self.world_size
        first = self.rank * local
        sequences = self.batch(prompts, first, first + local)
        keys = rollout_keys(self.seed, global_step, self.batch_size * self.group_size)
        return sequences, keys[first * self.group_size : (first + local) * self.group_size]

    def check_reward_call(self, prompts: Sequence[PromptInput]) -> None:
        """Raise ``ValueError`` before any rollout when a reward function returns the wrong
        number of scores, from a call on the first prompt twice (as a group repeats it) with
        empty completions (:meth:`Scorer.check_call`)."""
        texts, _, columns = self.prepare(prompts, 0, 1)
        self.scorer.check_call(texts * 2, repeat_columns(columns, 2))
