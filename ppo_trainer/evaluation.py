"""Evaluation: the training rollout (phases 1-3) on held-out prompts with the evaluation settings,
reduced to the mean reward, the KL to the reference and sample completions
(:meth:`ppo_trainer.ppo_trainer.PPOTrainer.evaluate`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Sequence

import numpy as np

from ppo_trainer.agent_rollout import agent_count_sums, agent_metrics
from ppo_trainer.experience import kl_per_token
from ppo_trainer.prompt_records import PromptInput
from ppo_trainer.rollout import SamplingSettings
from ppo_trainer.rollout_records import (
    rollout_arrays,
    rollout_records,
    select_rows,
    write_rollout_records,
)

if TYPE_CHECKING:
    from ppo_trainer.ppo_trainer import PPOTrainer


def evaluate_rollouts(
    trainer: PPOTrainer,
    prompts: Sequence[PromptInput],
    sampling: SamplingSettings,
    num_samples: int,
) -> dict[str, Any]:
    """Roll out ``prompts`` in chunks of ``rollout_batch_size`` with ``sampling`` (no values).

    Returns ``{"eval/mean_reward", "eval/kl", "eval/response_length", "samples"}`` (with tools or
    environments also ``eval/agent/turns``, ``eval/agent/tool_calls``,
    ``eval/agent/tool_call_success`` and ``eval/agent/context_tokens``), the KL summed
    over each response's tokens with the training's estimator, and the first ``num_samples``
    ``{"prompt", "completion", "reward"}``. While ``trainer`` records its evaluations (periodic
    evaluations during training), up to ``rollout_records_per_step`` rows are written to
    ``rollouts/step_NNNNNN_eval.jsonl``.
    """
    cfg = trainer.config
    rewards: list[float] = []
    kls: list[float] = []
    lengths: list[float] = []
    samples: list[dict[str, Any]] = []
    records: list[dict[str, Any]] = []
    agent: dict[str, float] = {}  # agents: the sums behind the agent metrics, over the batches
    record = trainer.run.record_eval
    for start in range(0, len(prompts), cfg.rollout_batch_size):
        stop = min(start + cfg.rollout_batch_size, len(prompts))
        texts, ids, columns = trainer._prepare_prompts(prompts, start, stop)
        rollout = trainer._rollout(texts, ids, columns, sampling, with_values=False)
        kl_tokens = kl_per_token(rollout, trainer.experience)  # (B, T)
        kl = kl_tokens.sum(axis=1)  # (B,)
        room = cfg.rollout_records_per_step - len(records)
        if record and room > 0:
            arrays = rollout_arrays(
                rollout,
                rollout.as_batch(),
                {"kl": kl_tokens},
                trainer.global_step,
                cfg.algorithm,
                source="eval",
            )
            rows = select_rows(len(texts), 1, room)
            records += rollout_records(arrays, trainer.tokenizer, rows)
        for key, value in agent_count_sums(rollout.agent_counts).items():
            agent[key] = agent.get(key, 0.0) + value
        rewards.extend(np.array(rollout.scores).tolist())
        kls.extend(np.array(kl).tolist())
        lengths.extend(np.array(rollout.generation.lengths).tolist())
        samples += [
            {"prompt": t, "completion": c, "reward": r}
            for t, c, r in zip(texts, rollout.completions, rewards[start:stop])
        ][: max(num_samples - len(samples), 0)]
    if record:
        write_rollout_records(trainer.run_dir, trainer.global_step, records, "eval")
    return {
        "eval/mean_reward": float(np.mean(rewards)),
        "eval/kl": float(np.mean(kls)),
        "eval/response_length": float(np.mean(lengths)),
        **(agent_metrics(agent, prefix="eval/agent/") if agent else {}),
        "samples": samples,
    }
