"""Phases 1-3 of an iteration: generate responses and score them with every model.

A run asks its :class:`RolloutSource` for each batch's :class:`Rollout`: one sampled response
per sequence (:mod:`ppo_trainer.single_turn`), multi-turn agent episodes
(:mod:`ppo_trainer.agent_rollout`), the asynchronous worker's responses
(:mod:`ppo_trainer.async_rollout`), or dynamic sampling over any of them
(:mod:`ppo_trainer.dynamic_sampling`); :mod:`ppo_trainer.rollout_sources` chooses, once.
Each ends in :func:`collect_rollout`, which training and evaluation both run, so they cannot
drift apart:

1. sample responses for the prompts (batched, KV cache, stopping at the stop tokens);
2. log-probs of the sampled tokens under the rollout policy and the frozen reference, and the
   value model's values, at the scoring temperature, all without gradients;
3. the completions' texts and their scores (reward model or function, via the trainer's
   ``compute_scores``), checked to be one finite float each.

Every array it returns is a constant for the losses that follow.
"""

from __future__ import annotations

import logging
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Any, Callable, Literal, Mapping, NamedTuple, Protocol, Sequence, cast

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

from base_setup.backend import (
    decoding_threads,
    generation_buffer_cache,
    parameter_count,
    release_cached_buffers,
    side_by_side,
)
from base_setup.lora_setup import (
    MergeSetting,
    adapters_merged,
    merge_adapters_for_sampling,
    mergeable_weight_bytes,
)
from base_setup.plain import speed_tricks
from experience_buffer.buffer import RolloutBatch
from models.offload import drop_read_weights
from models.policy_model import PolicyModel
from models.sft_model import ReferenceModel
from models.value_model import ValueModel
from ppo_trainer.generator import GenerationOutput, cut_after_stop_string, generate
from ppo_trainer.multi_turn import ContinueFn, generate_turns
from ppo_trainer.prompt_records import Columns, PromptInput, repeat_columns
from reward_kl.combined_reward import score_value
from token_attribution.sequences import (
    build_query_responses,
    gather_positions,
    logprobs_from,
    response_positions,
    ScoringInputs,
    scoring_inputs,
)

logger = logging.getLogger("ppo_mlx")

#: ``score(completions, query_responses, sequence_lengths) -> (B,)`` or ``((B,), metrics)``
#: (:func:`split_scores`), or either as a :class:`Scored` with what the rewards logged: the
#: trainer's reward, with the prompts and their columns bound.
ScoreFn = Callable[[list[str], mx.array, mx.array], Any]


class Scored(NamedTuple):
    """A score function's result with what its rewards logged beside the scores.

    Attributes:
        out: the scores, or ``(scores, metrics)`` (:func:`split_scores`).
        details: column -> one value per completion (``log_extra``'s, e.g. a judge's
            ``judge/prompt`` and ``judge/score``); empty when nothing was logged.
    """

    out: Any
    details: dict[str, list[Any]]


@dataclass(frozen=True)
class SamplingSettings:
    """How responses are sampled and scored.

    Attributes:
        max_new_tokens: most tokens per response.
        temperature: sampling temperature; 0 = greedy (log-probs then at temperature 1).
        top_p, top_k: nucleus and top-k filters (1.0 / 0 = off); log-probs are unfiltered.
        stop_token_ids: ids that end a response (the stop token is part of it).
        pad_token_id: id written after a response's end (never read: masks come from lengths).
        logprobs_from: "sampling" keeps the sampler's log-probs (the same function of the same
            logits), "forward" recomputes them with a forward pass over the whole sequences.
        stop_strings: texts that also end a response (kept in its completion).
        merge_adapters: whether a LoRA policy samples with its adapters merged into the base
            weights (:func:`sampling_adapters`): True, False or "auto".
    """

    max_new_tokens: int
    temperature: float
    top_p: float
    top_k: int
    stop_token_ids: Sequence[int]
    pad_token_id: int
    logprobs_from: Literal["sampling", "forward"] = "sampling"
    stop_strings: tuple[str, ...] = ()
    merge_adapters: MergeSetting = "auto"

    @classmethod
    def from_config(
        cls, config: Any, stop_token_ids: Sequence[int], pad_token_id: int
    ) -> SamplingSettings:
        """The rollout sampling of a ``PPOConfig``."""
        return cls(
            max_new_tokens=config.max_new_tokens,
            temperature=config.temperature,
            top_p=config.top_p,
            top_k=config.top_k,
            stop_token_ids=stop_token_ids,
            pad_token_id=pad_token_id,
            logprobs_from=config.rollout_logprobs,
            stop_strings=tuple(config.stop_strings or ()),
            merge_adapters=config.merge_adapters_for_sampling,
        )

    @property
    def scoring_temperature(self) -> float:
        """The temperature log-probs are taken at: the sampling one, 1 when greedy."""
        return self.temperature if self.temperature > 0 else 1.0


@dataclass
class Rollout:
    """What phases 1-3 produce for one batch of ``B`` sequences (``T`` response columns)."""

    texts: list[str]  # the formatted prompts
    completions: list[str]  # response texts without the stop token
    prompt_ids: list[list[int]]
    generation: GenerationOutput
    query_responses: mx.array  # (B, L) prompt, response, padding
    prompt_lengths: mx.array  # (B,)
    mask: mx.array  # (B, T) 1 on response tokens (the stop token included)
    logprobs: mx.array  # (B, T) rollout policy
    ref_logprobs: mx.array  # (B, T) reference
    entropy: mx.array  # (B, T) of the rollout policy's distribution
    values: mx.array | None  # (B, T) value model (PPO)
    scores: mx.array  # (B,) float32, finite
    #: What the score function returned beside the scores (scalar arrays; the default
    #: ``compute_scores``: each of several rewards' ``rewards/<name>/mean`` and ``/std``).
    reward_metrics: dict[str, mx.array] = field(default_factory=dict)
    #: What the rewards logged per completion (``log_extra``): column -> (B,) values, e.g. a
    #: judge's ``judge/prompt``, ``judge/score``; the rollout records' ``details``.
    reward_details: dict[str, list[Any]] = field(default_factory=dict)
    #: Agents: (B, K) per-action rewards (an environment's ``get_reward()`` list), landing on
    #: ``turn_ends`` (B, K), each policy turn's last column (-1: none); None without them.
    action_rewards: mx.array | None = None
    turn_ends: mx.array | None = None
    #: Agents: per episode, the counts behind the ``agent/`` metrics, each (B,) (episodes,
    #: turns, tool calls, successful calls, context tokens:
    #: ``ppo_trainer.agent_rollout.agent_counts``); empty without agents.
    agent_counts: dict[str, mx.array] = field(default_factory=dict)
    #: What the source measured beside the batch, logged with the step's metrics (dynamic
    #: sampling's rounds, the asynchronous worker's wait); empty for most sources.
    source_metrics: dict[str, float] = field(default_factory=dict)

    def as_batch(self) -> RolloutBatch:
        """The rollout as a batch without advantages (an evaluation: nothing learns from it)."""
        return RolloutBatch(
            query_responses=self.query_responses,
            prompt_lengths=self.prompt_lengths,
            responses=self.generation.responses,
            mask=self.mask,
            logprobs=self.logprobs,
            ref_logprobs=self.ref_logprobs,
            scores=self.scores,
            advantages=mx.zeros_like(self.scores),
            values=self.values,
        )


@dataclass(frozen=True)
class PromptBatch:
    """Prompts formatted and encoded for the policy, one entry per sequence: the formatted
    texts, their token ids and the columns of their records (each a list aligned with them)."""

    texts: list[str]
    prompt_ids: list[list[int]]
    columns: Columns

    def repeat(self, times: int) -> PromptBatch:
        """Each prompt ``times`` times in a row (a group's samples are adjacent)."""
        return PromptBatch(
            [t for t in self.texts for _ in range(times)],
            [p for p in self.prompt_ids for _ in range(times)],
            repeat_columns(self.columns, times),
        )


@dataclass(frozen=True)
class StepPlan:
    """What a training step tells its rollout source beyond its own batch.

    Attributes:
        step: the global step before this one (0-based), which numbers its PRNG keys and the
            worker's batches.
        prepare: a batch of prompts (or records) formatted, encoded, checked and repeated
            ``group_size`` times, as the step's own.
        next_prompts: the next step's prompts, which the asynchronous worker generates during
            this step's update (None: none, or no worker).
        more_prompts: ``more_prompts(k)``, the prompts of dynamic sampling's ``k``-th extra
            generation round (None: no extra rounds).
    """

    step: int
    prepare: Callable[[Sequence[PromptInput]], PromptBatch]
    next_prompts: Sequence[PromptInput] | None = None
    more_prompts: Callable[[int], Sequence[PromptInput]] | None = None


class RolloutSource(Protocol):
    """Where a run's rollouts come from (phases 1-3)."""

    def rollout(
        self,
        batch: PromptBatch,
        sampling: SamplingSettings,
        keys: mx.array | None,
        plan: StepPlan | None = None,
    ) -> Rollout:
        """The rollout of ``batch`` sampled with ``sampling``, sequence ``b`` from ``keys[b]``
        (None: the global random state). ``plan``: a training step's; None for an evaluation,
        which takes no values (nothing learns from it), no worker and no extra rounds."""
        ...


def sampling_adapters(policy: PolicyModel, setting: MergeSetting) -> AbstractContextManager[object]:
    """The block a LoRA policy samples in: :func:`base_setup.lora_setup.adapters_merged` (each
    float32 adapted layer one merged weight ``W + scale B^T A^T``, one matmul per layer and
    decoding step instead of three; the sampling log-probs then differ from the loss's
    recomputation by float32 rounding, as a decoding step's already do) when ``setting`` asks
    for it (:func:`base_setup.lora_setup.merge_adapters_for_sampling`: "auto" for small layers
    and a copy of at most an eighth of MLX's memory limit), else the plain LoRA forward. Never under
    plain MLX, nor off the CPU (:func:`base_setup.plain.speed_tricks`)."""
    if not speed_tricks():
        return nullcontext()
    sizes = mergeable_weight_bytes(policy.model)
    if merge_adapters_for_sampling(setting, sizes, int(mx.get_memory_limit())):
        return adapters_merged(policy.model)
    return nullcontext()


def few_row_model(policy: PolicyModel) -> bool:
    """Whether ``policy`` is a model the few-row kernel serves
    (:func:`base_setup.fast_layers.few_row_sized`): its decoding steps leave the Python thread a
    core (:func:`base_setup.backend.decoding_threads`)."""
    from base_setup.fast_layers import few_row_sized

    return few_row_sized(policy.model)


def sample_responses(
    policy: PolicyModel,
    prompt_ids: list[list[int]],
    sampling: SamplingSettings,
    keys: mx.array | None = None,
) -> GenerationOutput:
    """Phase 1: ``policy``'s responses to ``prompt_ids`` with ``sampling``, with their sampling
    log-probs and entropy (batched, KV cache, stopping at the stop tokens; the filters only when
    sampling, not greedy). ``keys``: one PRNG key per sequence, or None for the global state.
    The trainer's rollouts and the asynchronous rollout worker both sample with it.

    A LoRA policy on a float32 base may sample with its adapters merged into the base weights
    (:func:`sampling_adapters`). Stop strings are looked for in the text of the policy's
    tokenizer."""
    merged = sampling_adapters(policy, sampling.merge_adapters)
    with generation_buffer_cache(), merged, decoding_threads(few_row_model(policy)):
        return generate(
            policy,
            prompt_ids,
            max_new_tokens=sampling.max_new_tokens,
            temperature=sampling.temperature,
            top_p=sampling.top_p if sampling.temperature > 0 else 1.0,
            top_k=sampling.top_k if sampling.temperature > 0 else 0,
            stop_token_ids=list(sampling.stop_token_ids),
            pad_token_id=sampling.pad_token_id,
            return_logprobs=True,
            keys=keys,
            stop_strings=sampling.stop_strings,
            decode=lambda ids: str(policy.tokenizer.decode(ids, skip_special_tokens=True)),
        )


def sample_episodes(
    policy: PolicyModel,
    prompt_ids: list[list[int]],
    sampling: SamplingSettings,
    continue_fn: ContinueFn,
    keys: mx.array | None = None,
) -> GenerationOutput:
    """Phase 1 for multi-turn episodes (agents): as :func:`sample_responses`, with
    :func:`ppo_trainer.multi_turn.generate_turns` (``max_new_tokens`` bounds each episode's
    tokens after its prompt, tool results included; a stop string ends a turn as a stop
    token does)."""
    merged = sampling_adapters(policy, sampling.merge_adapters)
    with generation_buffer_cache(), merged, decoding_threads(few_row_model(policy)):
        return generate_turns(
            policy,
            prompt_ids,
            continue_fn=continue_fn,
            max_new_tokens=sampling.max_new_tokens,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            top_k=sampling.top_k,
            stop_token_ids=list(sampling.stop_token_ids),
            pad_token_id=sampling.pad_token_id,
            keys=keys,
            stop_strings=sampling.stop_strings,
            decode=lambda ids: str(policy.tokenizer.decode(ids, skip_special_tokens=True)),
        )


def collect_rollout(
    policy: PolicyModel,
    ref_model: ReferenceModel | None,
    value_model: ValueModel | None,
    texts: list[str],
    prompt_ids: list[list[int]],
    sampling: SamplingSettings,
    *,
    decode: Callable[[GenerationOutput], list[str]],
    score: ScoreFn,
    score_source: str,
    keys: mx.array | None = None,
    generation: GenerationOutput | None = None,
    model_reward: bool = False,
) -> Rollout:
    """Phases 1-3 (see the module doc) for prompts already formatted and encoded.

    Args:
        ref_model: the frozen reference, or None when the run has no KL term: the reference is
            then the rollout policy itself (``ref_logprobs = logprobs``, a KL of 0), and no
            reference pass runs.
        decode: the completions' texts (without their stop tokens) of a generation.
        score: the scores of the completions (see :data:`ScoreFn`).
        score_source: what computes the scores, named when they are malformed.
        keys: one PRNG key per sequence (so a row's sample does not depend on the others), or
            None for the global random state.
        generation: responses already sampled, with their behaviour log-probs and entropy (the
            asynchronous rollout worker's, from the policy of one update earlier, or multi-turn
            episodes): phase 1 is skipped and their log-probs are the rollout's
            (``sampling.logprobs_from`` must be "sampling", except for episodes sampled by the
            current policy: those with an ``action_mask``); or without log-probs (GKD's data
            completions), which then needs "forward". With an ``action_mask`` it is the
            rollout's mask: only the policy's tokens are actions.
        model_reward: ``score`` runs a model's pass and returns it unevaluated (the trainer's
            reward model): on the CPU it then runs beside the reference's pass when there is
            no value model (a scheduling choice; the values are the same either way).
    """
    # 1. Generate (batched, KV cache); the generator stops at the stop tokens and pads after.
    if generation is not None:
        check_given_generation(generation, sampling.logprobs_from)
        gen = generation
    else:
        gen = sample_responses(policy, prompt_ids, sampling, keys)
    num_tokens = gen.responses.shape[1]
    mask = (mx.arange(num_tokens)[None, :] < gen.lengths[:, None]).astype(mx.float32)  # (B, T)
    if gen.action_mask is not None:  # multi-turn: tool and environment tokens are not actions
        mask = gen.action_mask  # (B, T)
    query_responses, prompt_lengths = build_query_responses(
        prompt_ids, gen.responses, sampling.pad_token_id
    )
    # 2. Log-probs under the rollout policy and the reference, and values: no gradients here.
    # The sampler's log-probs are log_softmax(logits / temperature) of the same weights (eval
    # mode, as here); "forward" recomputes them over whole sequences instead.
    positions = response_positions(prompt_lengths, num_tokens)  # (B, T)
    completions = decode(gen)  # text without the stop token
    sequence_lengths = prompt_lengths + gen.lengths
    passes = model_passes(
        policy,
        ref_model,
        value_model,
        query_responses,
        positions,
        forward=sampling.logprobs_from == "forward",
        reward=(
            (lambda: score(completions, query_responses, sequence_lengths))
            if model_reward
            else None
        ),
    )
    logprobs, entropy, ref_logprobs = passes.logprobs(gen, sampling.scoring_temperature)
    mx.async_eval(logprobs, entropy, ref_logprobs)

    # 3. Scores of the completions (a reward function runs while the heads' log-probs do).
    raw = passes.reward
    if not passes.reward_in_lane:
        raw = score(completions, query_responses, sequence_lengths)
    details: dict[str, list[Any]] = {}
    if isinstance(raw, Scored):
        raw, details = raw
    raw, reward_metrics = split_scores(raw, score_source)
    mx.eval(logprobs, entropy, ref_logprobs, arrays_in(raw))
    scores = check_scores(raw, len(texts), score_source)
    drop_read_weights()  # frozen models kept on disk let go of what this phase read ...
    release_cached_buffers()  # ... and the phase ends (base_setup.backend): both are freed
    return Rollout(
        texts,
        completions,
        prompt_ids,
        gen,
        query_responses,
        prompt_lengths,
        mask,
        logprobs,
        ref_logprobs,
        entropy,
        passes.values,
        scores,
        reward_metrics,
        reward_details=details,
    )


def check_given_generation(generation: GenerationOutput, logprobs_from: str) -> None:
    """Raise ``ValueError`` unless a generation made elsewhere (:func:`collect_rollout`'s
    ``generation``) and ``logprobs_from`` agree: one without log-probs (the data's completions)
    needs a forward pass; one with its behaviour log-probs, and no action mask, is scored by them.
    """
    if generation.logprobs is None and logprobs_from != "forward":
        raise ValueError(
            "a generation without log-probs (the data's completions) is scored by a forward "
            'pass: use logprobs_from "forward"'
        )
    if logprobs_from != "sampling" and generation.action_mask is None:
        if generation.logprobs is not None:
            raise ValueError(
                "a generation made elsewhere brings its behaviour log-probs: use logprobs_from "
                '"sampling"'
            )


class ModelPasses(NamedTuple):
    """The models' passes over a rollout's sequences (:func:`model_passes`), evaluated."""

    ref_inputs: ScoringInputs | None  # the reference's, for its log-probs
    policy_inputs: ScoringInputs | None  # the policy's, with logprobs_from "forward"
    values: mx.array | None  # (B, T) the value model's
    reward: Any  # the reward model's pass when it ran beside the reference's, else None
    reward_in_lane: bool  # whether it did

    def logprobs(
        self, gen: GenerationOutput, temperature: float
    ) -> tuple[mx.array, mx.array, mx.array]:
        """``(logprobs, entropy, ref_logprobs)``, each (B, T), of ``gen``'s responses at
        ``temperature``: the sampler's (or the policy's pass's) and the reference's (without a
        reference, the rollout policy's: a KL of 0)."""
        logprobs, entropy = gen.logprobs, gen.entropy
        if self.policy_inputs is not None:
            logprobs, entropy = logprobs_from(
                self.policy_inputs,
                gen.responses,
                temperature,
                with_entropy=True,
                differentiable=False,
            )
        assert logprobs is not None and entropy is not None
        if self.ref_inputs is None:
            return logprobs, entropy, logprobs  # no KL term: the rollout policy is the reference
        ref_logprobs, _ = logprobs_from(
            self.ref_inputs, gen.responses, temperature, differentiable=False
        )
        return logprobs, entropy, ref_logprobs


def model_passes(
    policy: PolicyModel,
    ref_model: ReferenceModel | None,
    value_model: ValueModel | None,
    query_responses: mx.array,
    positions: mx.array,
    *,
    forward: bool,
    reward: Callable[[], Any] | None,
) -> ModelPasses:
    """Phase 2's passes over ``query_responses`` (B, L) at the response ``positions`` (B, T),
    without gradients: the reference's, the policy's when ``forward`` (its log-probs
    recomputed), the value model's, and ``reward()`` (a reward model's pass, None: the
    reward is no model) when it can run beside the reference's.

    The passes depend on the rollout only. On the CPU the reference's (and the policy's) runs
    on one stream while the value model's, or else a reward model's, runs on another
    (base_setup.backend.side_by_side): passes of equal depth, which MLX's evaluation
    interleaves. The LM heads' log-probs and the remaining reward follow with every thread.
    """
    two = (value_model is not None or reward is not None) and side_by_side_pays(
        ref_model if ref_model is not None else policy, query_responses
    )
    reward_in_lane = two and value_model is None
    with side_by_side(2 if two else 1) as lanes:
        with lanes[0]:
            ref_inputs = (
                scoring_inputs(ref_model, query_responses, positions)
                if ref_model is not None
                else None
            )
            policy_inputs = scoring_inputs(policy, query_responses, positions) if forward else None
        values = raw = None
        with lanes[-1]:
            if value_model is not None:
                values = gather_positions(value_model(query_responses), positions)  # (B, T)
            if reward_in_lane:
                assert reward is not None
                raw = reward()
        mx.eval(
            [] if ref_inputs is None else ref_inputs.states,
            [] if policy_inputs is None else policy_inputs.states,
            values,
            arrays_in(raw),  # the scores inside a Scored or (scores, metrics): run in the lane
        )
    return ModelPasses(ref_inputs, policy_inputs, values, raw, reward_in_lane)


def arrays_in(tree: Any) -> list[mx.array]:
    """The MLX arrays among the leaves of ``tree`` (lists, tuples, named tuples such as
    :class:`Scored`, dicts): what a score function returned, for ``mx.eval``, which refuses
    other leaves (a judge's logged prompts are strings)."""
    leaves = cast(list[tuple[str, Any]], tree_flatten(tree))
    return [leaf for _, leaf in leaves if isinstance(leaf, mx.array)]


#: Token-parameters (the sequences' tokens times the reference model's parameters) below which
#: the scoring passes stay on one stream: for small work two streams' set-up and one-thread
#: matmuls cost more than the second core gives. The bound lies between the tiny test model's
#: work (16 x 46 tokens x 3.7M parameters: 2.7e9), where two streams lose, and SmolLM2-135M's
#: (16 x 142 x 134.5M: 3.1e11), where they win (benchmarks/cpu_streams.py).
MIN_SIDE_BY_SIDE_WORK = 3e10


def side_by_side_pays(ref_model: ReferenceModel | PolicyModel, query_responses: mx.array) -> bool:
    """Whether a rollout's scoring passes over ``query_responses`` with the reference model's
    (or, without one, the policy's) size are big enough to run on two CPU streams
    (:data:`MIN_SIDE_BY_SIDE_WORK`)."""
    return query_responses.size * parameter_count(ref_model.model) >= MIN_SIDE_BY_SIDE_WORK


def rollout_keys(seed: int, step: int, n: int, extra_round: int = 0) -> mx.array:
    """One PRNG key per sequence of a global rollout batch of ``n`` sequences, (n, 2).

    Sequence ``k`` (sample ``k % group_size`` of prompt ``k // group_size``) samples from key
    ``k`` whichever rank generates it, so a data-parallel run draws the responses one process
    would, and a resumed run those of an uninterrupted one. ``extra_round``: the step's extra
    generation round (dynamic sampling), each with keys of its own.
    """
    entropy = [seed, step, 2] if extra_round == 0 else [seed, step, 2, extra_round]
    key_seed = int(np.random.default_rng(entropy).integers(2**63))
    return mx.random.split(mx.random.key(key_seed), n)


def ended_at_once(gen: GenerationOutput) -> bool:
    """Whether every response of ``gen`` is its stop token alone (an empty completion): a sign
    of prompts in the wrong format (a chat model given plain text without its template)."""
    first_stop = (gen.lengths == 1) & gen.ended_with_stop  # (B,)
    return bool(mx.all(first_stop).item())


def warn_if_ended_at_once(gen: GenerationOutput, step: int, use_chat_template: Any) -> None:
    """Warn when every response of step ``step`` ended at once (:func:`ended_at_once`)."""
    if ended_at_once(gen):
        logger.warning(
            "step %d: every response ended at once with a stop token (empty completions); "
            "PPO learns nothing from them but to stop. Plain prompts to a chat model "
            "without its chat template do this: check use_chat_template (now %s) and the "
            "prompt format",
            step,
            str(use_chat_template).lower(),
        )


def decode_completions(
    gen: GenerationOutput,
    decode: Callable[[Sequence[int]], str],
    stop_strings: Sequence[str] = (),
) -> list[str]:
    """Texts of the generated responses, each decoded without its stop token; one a stop
    string ended is decoded whole and cut right after the stop string (which it keeps): the
    first in its text, or for a multi-turn episode (``turn_spans``) the last, its last turn's."""
    lengths = np.array(gen.lengths)
    by_string = (
        np.zeros(len(lengths), bool)
        if gen.stopped_by_string is None
        else np.array(gen.stopped_by_string)
    )
    token_stop = np.array(gen.ended_with_stop) & ~by_string
    ends = (lengths - token_stop.astype(np.int64)).tolist()
    rows = np.array(gen.responses).tolist()
    texts = [decode(row[:end]) for row, end in zip(rows, ends)]
    last = gen.turn_spans is not None
    return [
        cut_after_stop_string(text, stop_strings, last=last) if cut else text
        for text, cut in zip(texts, by_string.tolist())
    ]


def split_scores(out: Any, source: str) -> tuple[Any, dict[str, mx.array]]:
    """A score function's result as ``(scores, metrics)``: it returns the scores alone (an array
    or a list of floats, one per completion) or the pair ``(scores, metrics)``, ``metrics`` a
    dict of scalars (arrays or floats) logged with the step's metrics."""
    if not (isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], Mapping)):
        return out, {}
    scores, metrics = out
    checked: dict[str, mx.array] = {}
    for key, value in metrics.items():
        array = value if isinstance(value, mx.array) else mx.array(value)
        if not isinstance(key, str) or array.size != 1:
            raise ValueError(
                f"{source} returned the metric {key!r} of shape {tuple(array.shape)}: metrics "
                "must be named scalars, e.g. {'rewards/mine/mean': scores.mean()}"
            )
        checked[key] = array.reshape(())
    return scores, checked


def check_scores(scores: Any, expected: int, source: str) -> mx.array:
    """``scores`` as a (B,) float32 array, or ``ValueError`` naming ``source`` and what is wrong:
    not numbers (strings, None), not one per completion, or not finite."""
    if isinstance(scores, mx.array):
        if not mx.issubdtype(scores.dtype, mx.number) or scores.dtype == mx.bool_:
            raise ValueError(f"{source} returned an array of {scores.dtype}, not numbers")
        values = np.asarray(scores.astype(mx.float32)).reshape(-1)
    else:
        items = list(scores) if isinstance(scores, (list, tuple, np.ndarray)) else None
        if items is None:
            raise ValueError(
                f"{source} returned {type(scores).__name__} {scores!r:.60}; it must return one "
                "float per completion (a list or array)"
            )
        bad = [
            (i, v)
            for i, v in enumerate(items)
            if isinstance(v, bool) or not isinstance(v, (int, float, np.number))
        ]
        if bad:
            index, value = bad[0]
            raise ValueError(
                f"{source} returned {type(value).__name__} {value!r:.40} for completion {index} "
                f"({len(bad)} of {len(items)} are not numbers); it must return one float per "
                "completion"
            )
        # An int beyond float's range (10**400) is inf here, refused below with the rest.
        values = np.asarray([score_value(v) for v in items], dtype=np.float64).reshape(-1)
    if values.size != expected:
        raise ValueError(
            f"{source} returned {values.size} scores for {expected} completions: it must "
            "return exactly one float per completion"
        )
    with np.errstate(over="ignore"):
        as32 = values.astype(np.float32)
    finite = np.isfinite(as32)
    if not finite.all():
        bad_rows = np.flatnonzero(~finite).tolist()
        raise ValueError(
            f"{source} returned non-finite scores (NaN, inf, or beyond float32's 3.4e38) for "
            f"completions {bad_rows[:10]}: fix the reward; no update was made for this batch"
        )
    return mx.array(as32)


def check_prompts(
    prompt_ids: Sequence[Sequence[int]],
    texts: Sequence[str],
    *,
    max_prompt_length: int,
    max_new_tokens: int,
    context_length: int | None,
) -> None:
    """Raise ``ValueError`` (naming the prompt) for an empty prompt, one longer than
    ``max_prompt_length``, or one that with ``max_new_tokens`` exceeds the model's context."""
    for i, ids in enumerate(prompt_ids):
        if not ids:
            raise ValueError(f"prompt {i} is empty after formatting and tokenisation")
        if len(ids) > max_prompt_length:
            raise ValueError(
                f"prompt {i} has {len(ids)} tokens, more than max_prompt_length="
                f"{max_prompt_length} ({texts[i][:60]!r}...): shorten it or raise "
                "max_prompt_length"
            )
        if context_length is not None and len(ids) + max_new_tokens > context_length:
            raise ValueError(
                f"prompt {i} ({len(ids)} tokens) + max_new_tokens={max_new_tokens} exceeds "
                f"the model's context of {context_length} tokens: shorten the prompt or lower "
                "max_new_tokens"
            )
