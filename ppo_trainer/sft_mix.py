"""The SFT examples mixed into the policy's updates (``sft_coef``, OpenRLHF's ``ptx_coef``): one
batch per optimiser update, taken in order from a stream of shuffled passes over the data.

The stream is a function of the seed alone, so the batch of an update depends only on the
cursor (examples taken so far), which the run's checkpoints save: a resumed run takes the same
batches as an uninterrupted one.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from finetune.records import load_sft_data
from finetune.tokenize import SFTBatch, SFTExample, collate_sft, tokenize_sft


def sft_stream_indices(cursor: int, count: int, num_examples: int, seed: int) -> list[int]:
    """Entries ``cursor .. cursor + count - 1`` of the example stream: pass ``e`` over the data
    is the permutation ``default_rng([seed, e, 2]).permutation(num_examples)``, and entry ``i``
    is element ``i % num_examples`` of pass ``i // num_examples``."""
    if num_examples < 1 or count < 0 or cursor < 0:
        raise ValueError(
            f"need num_examples >= 1, count >= 0, cursor >= 0; got {num_examples}, {count}, "
            f"{cursor}"
        )
    passes: dict[int, np.ndarray] = {}
    out = []
    for i in range(cursor, cursor + count):
        epoch, k = divmod(i, num_examples)
        if epoch not in passes:
            passes[epoch] = np.random.default_rng([seed, epoch, 2]).permutation(num_examples)
        out.append(int(passes[epoch][k]))
    return out


class SFTMix:
    """The tokenised SFT examples of a run and its cursor into their stream.

    Args:
        examples: the tokenised records (at least one).
        batch_size: examples per batch.
        seed: the run's seed (the stream's order).
        pad_token_id: the padding of the batches.
        pad_to_multiple_of: round the batches' widths up to a multiple of it (None: no
            rounding), as a compiled gradient wants (``training.compiled_gradient``).
    """

    def __init__(
        self,
        examples: Sequence[SFTExample],
        batch_size: int,
        seed: int,
        pad_token_id: int,
        pad_to_multiple_of: int | None = None,
    ) -> None:
        if not examples:
            raise ValueError("sft_data holds no examples")
        self.examples = list(examples)
        self.batch_size = batch_size
        self.seed = seed
        self.pad_token_id = pad_token_id
        self.pad_to_multiple_of = pad_to_multiple_of
        #: Examples taken so far (checkpointed).
        self.cursor = 0

    def next_batch(self) -> SFTBatch:
        """The next ``batch_size`` examples of the stream, right-padded; advances the cursor."""
        indices = sft_stream_indices(self.cursor, self.batch_size, len(self.examples), self.seed)
        self.cursor += self.batch_size
        examples = [self.examples[i] for i in indices]
        return collate_sft(examples, self.pad_token_id, self.pad_to_multiple_of)


def load_sft_mix(
    config: Any, tokenizer: Any, pad_to_multiple_of: int | None = None
) -> SFTMix | None:
    """The run's :class:`SFTMix` (None when ``sft_coef`` is 0): ``sft_data`` loaded and checked
    as the sft command reads it, tokenised to at most ``max_prompt_length + max_new_tokens``
    tokens, in batches of ``sft_batch_size`` (None: ``micro_batch_size``), their widths rounded
    up to a multiple of ``pad_to_multiple_of`` when given.

    Raises:
        FileNotFoundError, ValueError: missing or malformed data (before any rollout).
    """
    if config.sft_coef == 0:
        return None
    records = load_sft_data(config.sft_data)
    examples = tokenize_sft(records, tokenizer, config.max_prompt_length + config.max_new_tokens)
    size = config.sft_batch_size or config.micro_batch_size
    return SFTMix(examples, size, config.seed, int(tokenizer.pad_token_id), pad_to_multiple_of)
