"""Evaluation: the training rollout (phases 1-3) on held-out prompts with the evaluation settings,
reduced to the mean reward, the KL to the reference and sample completions
(:meth:`ppo_trainer.ppo_trainer.PPOTrainer.evaluate`, through :class:`Evaluator`)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from config.ppo_config import PPOConfig
from ppo_trainer.agent_rollout import agent_count_sums, agent_metrics
from ppo_trainer.experience import ExperienceSettings, kl_per_token
from ppo_trainer.prompt_batches import PromptPreparation
from ppo_trainer.prompt_records import PromptInput
from ppo_trainer.rollout import PromptBatch, Rollout, RolloutSource, SamplingSettings
from ppo_trainer.rollout_records import (
    rollout_arrays,
    rollout_records,
    select_rows,
    write_rollout_records,
)

#: ``roll_out(start, stop)``: prompts ``start:stop`` rolled out with the evaluation's sampling
#: settings and no values; returns their formatted texts and the rollout.
RollOut = Callable[[int, int], tuple[list[str], Rollout]]


def evaluate_rollouts(
    roll_out: RollOut,
    num_prompts: int,
    num_samples: int,
    *,
    config: PPOConfig,
    experience: ExperienceSettings,
    tokenizer: Any,
    records_at: tuple[Path, int] | None = None,
) -> dict[str, Any]:
    """Roll out ``num_prompts`` prompts in chunks of ``rollout_batch_size`` (``roll_out``).

    Returns ``{"eval/mean_reward", "eval/kl", "eval/response_length", "samples"}`` (with tools or
    environments also ``eval/agent/turns``, ``eval/agent/tool_calls``,
    ``eval/agent/tool_call_success`` and ``eval/agent/context_tokens``), the KL summed
    over each response's tokens with the training's estimator (``experience``), and the first
    ``num_samples`` ``{"prompt", "completion", "reward"}``. ``records_at``: ``(run_dir, step)``
    of a run that records its evaluations (periodic evaluations during training): up to
    ``rollout_records_per_step`` rows go to ``<run_dir>/rollouts/step_NNNNNN_eval.jsonl``;
    None: no records.
    """
    cfg = config
    rewards: list[float] = []
    kls: list[float] = []
    lengths: list[float] = []
    samples: list[dict[str, Any]] = []
    records: list[dict[str, Any]] = []
    agent: dict[str, float] = {}  # agents: the sums behind the agent metrics, over the batches
    for start in range(0, num_prompts, cfg.rollout_batch_size):
        stop = min(start + cfg.rollout_batch_size, num_prompts)
        texts, rollout = roll_out(start, stop)
        kl_tokens = kl_per_token(rollout, experience)  # (B, T)
        kl = kl_tokens.sum(axis=1)  # (B,)
        room = cfg.rollout_records_per_step - len(records)
        if records_at is not None and room > 0:
            arrays = rollout_arrays(
                rollout,
                rollout.as_batch(),
                {"kl": kl_tokens},
                records_at[1],
                cfg.algorithm,
                source="eval",
            )
            rows = select_rows(len(texts), 1, room)
            records += rollout_records(arrays, tokenizer, rows)
        for key, value in agent_count_sums(rollout.agent_counts).items():
            agent[key] = agent.get(key, 0.0) + value
        rewards.extend(np.array(rollout.scores).tolist())
        kls.extend(np.array(kl).tolist())
        lengths.extend(np.array(rollout.generation.lengths).tolist())
        samples += [
            {"prompt": t, "completion": c, "reward": r}
            # rollout.texts: the prompts the policy continued (an agent's rendered with its tools)
            for t, c, r in zip(rollout.texts, rollout.completions, rewards[start:stop])
        ][: max(num_samples - len(samples), 0)]
    if records_at is not None:
        write_rollout_records(records_at[0], records_at[1], records, "eval")
    return {
        "eval/mean_reward": float(np.mean(rewards)),
        "eval/kl": float(np.mean(kls)),
        "eval/response_length": float(np.mean(lengths)),
        **(agent_metrics(agent, prefix="eval/agent/") if agent else {}),
        "samples": samples,
    }


@dataclass(frozen=True)
class Evaluator:
    """A run's evaluation (:meth:`PPOTrainer.evaluate`), built once: its prompts prepared as
    training's (``preparation``), rolled out by the run's ``source`` with the training's
    ``sampling`` turned to the evaluation's, reduced by :func:`evaluate_rollouts` (the KL with
    the training's estimator, ``experience``; records decoded by ``tokenizer``)."""

    preparation: PromptPreparation
    source: RolloutSource
    sampling: SamplingSettings
    experience: ExperienceSettings
    tokenizer: Any
    config: PPOConfig

    def evaluate(
        self,
        prompts: Sequence[PromptInput],
        max_new_tokens: int | None,
        temperature: float | None,
        num_samples: int,
        records_at: tuple[Path, int] | None = None,
    ) -> dict[str, Any]:
        """``prompts`` evaluated: greedy when the temperature (default
        ``config.eval_temperature``) is 0, at most ``max_new_tokens`` (default
        ``config.eval_tokens``) per response, log-probs at the sampling temperature (1 when
        greedy); see :func:`evaluate_rollouts` for the result and ``records_at``."""
        cfg = self.config
        if not prompts:
            raise ValueError("evaluate() got an empty prompt list")
        sampling = replace(
            self.sampling,
            max_new_tokens=max_new_tokens or cfg.eval_tokens,
            temperature=cfg.eval_temperature if temperature is None else temperature,
            logprobs_from="sampling",
        )

        def roll_out(start: int, stop: int) -> tuple[list[str], Rollout]:
            batch = PromptBatch(*self.preparation.prepare(prompts, start, stop))
            return batch.texts, self.source.rollout(batch, sampling, None)

        return evaluate_rollouts(
            roll_out,
            len(prompts),
            num_samples,
            config=cfg,
            experience=self.experience,
            tokenizer=self.tokenizer,
            records_at=records_at,
        )
