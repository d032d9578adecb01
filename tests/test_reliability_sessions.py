"""Long sessions: a chat that outgrows the model's context (it took 12 minutes and 5.3 GB past
2,048 tokens, without a word), a line longer than the context, a closed terminal (SIGHUP), the
way out of a full disk."""

from __future__ import annotations

import io
import os
import signal
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from config.ppo_config import PPOConfig
from fixtures.tiny_corpus import review_prompts
from models.policy_model import PolicyModel
from ppo_trainer.callbacks import TrainerCallback
from ppo_trainer.chat import SamplingSettings, chat_session, generate_text, prompt_budget
from ppo_trainer.ppo_trainer import PPOTrainer
from training.run_control import stop_exit_code


def test_chat_trims_its_history_to_the_context_and_names_a_line_too_long(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    policy = PolicyModel.from_pretrained(tiny_model_dir)
    settings = SamplingSettings(max_tokens=4, temperature=0.0)
    turns = [f"tell me about item number {k} please" for k in range(8)]
    too_long = "word " * 200
    stdin = io.StringIO("\n".join(turns + [too_long, "and the last one"]) + "\n")
    stdout = io.StringIO()
    context = 120
    prompts: list[int] = []

    import ppo_trainer.chat as chat_module

    real = chat_module.stream_reply

    def recording(model: Any, tokenizer: Any, ids: list[int], s: SamplingSettings) -> Any:
        prompts.append(len(ids))
        return real(model, tokenizer, ids, s)

    monkeypatch.setattr(chat_module, "stream_reply", recording)
    messages = chat_session(
        policy.model, policy.tokenizer, settings, stdin=stdin, stdout=stdout, context=context
    )
    text = stdout.getvalue()
    budget = prompt_budget(context, settings.max_tokens)
    assert budget == 116 and max(prompts) <= budget
    assert "outgrew the model's context of 120 tokens: dropped the 1 oldest" in text
    assert "(this message is" in text and "leaves 116 for the prompt" in text
    assert len(prompts) == len(turns) + 1  # the long line got no reply, the session went on
    assert messages[-2]["content"] == "and the last one"
    assert messages[0]["content"] != turns[0]  # the oldest turns went
    assert all(m["content"] != too_long.strip() for m in messages)


def test_generate_names_a_prompt_longer_than_the_context(tiny_model_dir: Path) -> None:
    policy = PolicyModel.from_pretrained(tiny_model_dir)
    settings = SamplingSettings(max_tokens=4, temperature=0.0)
    with pytest.raises(ValueError, match=r"the prompt is \d+ tokens; the model's context of 50"):
        generate_text(policy.model, policy.tokenizer, "word " * 100, settings, context=50)


def test_chat_replaces_bytes_that_are_not_utf8_and_keeps_the_session(
    tiny_model_dir: Path,
) -> None:
    """issue #47: a line that is not UTF-8 crashed chat (a traceback; the history lost): a
    strict stream raised UnicodeDecodeError, a surrogateescape one (C.UTF-8) gave the
    tokenizer lone surrogates."""
    policy = PolicyModel.from_pretrained(tiny_model_dir)
    settings = SamplingSettings(max_tokens=2, temperature=0.0)
    data = b"hello\nReview \xff\xfe of\nbye\n"
    for errors in ("strict", "surrogateescape"):
        stdin = io.TextIOWrapper(io.BytesIO(data), encoding="utf-8", errors=errors)
        stdout = io.StringIO()
        messages = chat_session(
            policy.model, policy.tokenizer, settings, stdin=stdin, stdout=stdout
        )
        users = [m["content"] for m in messages if m["role"] == "user"]
        assert users == ["hello", "Review \ufffd\ufffd of", "bye"], errors
        assert "not UTF-8: 2 byte(s) replaced by U+FFFD" in stdout.getvalue()


def test_generate_refuses_a_prompt_that_is_not_utf8_naming_the_byte(
    tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import main

    policy = PolicyModel.from_pretrained(tiny_model_dir)
    settings = SamplingSettings(max_tokens=2, temperature=0.0)
    prompt = b"Review \xff of".decode("utf-8", "surrogateescape")  # as argv holds it
    with pytest.raises(ValueError, match=r"the prompt is not UTF-8 text: byte 7 \(0xff\)"):
        generate_text(policy.model, policy.tokenizer, prompt, settings, chat=False)
    # The command line: the same one line, exit 2, before the model is loaded.
    assert main.main(["generate", "--model", str(tmp_path / "none"), "--prompt", prompt]) == 2
    assert "the prompt is not UTF-8 text: byte 7 (0xff)" in capsys.readouterr().err


class _HangUp(TrainerCallback):
    def on_step_end(self, trainer: Any, step: int, metrics: dict[str, float]) -> None:
        if step == 1:
            os.kill(os.getpid(), signal.SIGHUP)  # the terminal that started the run closed


def test_sighup_finishes_the_step_and_saves_like_sigterm(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """SIGHUP killed the run where it was: the step's work lost, no checkpoint."""
    config = PPOConfig(
        model_name=str(tiny_model_dir),
        max_new_tokens=4,
        batch_size=2,
        num_ppo_epochs=1,
        output_dir=str(tmp_path / "run"),
        progress_bar=False,
        total_steps=5,
    )
    trainer = PPOTrainer(config, reward_model=lambda p, c: [float(len(x)) for x in c])
    outside: list[int] = []  # a handler of our own, so that a run that ignores SIGHUP is
    previous = signal.signal(signal.SIGHUP, lambda n, f: outside.append(n))  # not killed
    try:
        trainer.train(review_prompts(8, seed=0), callbacks=[_HangUp()])
        assert outside == []  # the run's handler took it, and put ours back
        assert signal.getsignal(signal.SIGHUP) is not signal.SIG_DFL
    finally:
        signal.signal(signal.SIGHUP, previous)
    assert trainer.stop_reason == "SIGHUP" and trainer.global_step == 1
    assert (tmp_path / "run" / "checkpoints" / "step_000001" / "manifest.json").is_file()
    assert stop_exit_code("SIGHUP") == 129


@pytest.mark.slow
def test_after_a_full_disk_before_any_checkpoint_the_way_out_it_names_works(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """It said "start the run again", which was refused (the folder held the run's metrics),
    while --resume latest found no checkpoint: no way out but deleting files by hand."""
    import mlx.core as mx

    from training.checkpoint import CheckpointWriteError

    def full(path: str, arrays: Any, metadata: Any = None) -> None:
        raise RuntimeError("[write] Unable to write 8391 bytes to file.")  # what MLX raises

    config = PPOConfig(
        model_name=str(tiny_model_dir),
        max_new_tokens=4,
        batch_size=2,
        num_ppo_epochs=1,
        output_dir=str(tmp_path / "run"),
        progress_bar=False,
        total_steps=2,
    )
    reward = length_reward
    monkeypatch.setattr(mx, "save_safetensors", full)
    with pytest.raises(CheckpointWriteError) as info:
        PPOTrainer(config, reward_model=reward).train(review_prompts(8, seed=0))
    assert "start the run again with --overwrite" in str(info.value)
    monkeypatch.undo()  # space freed
    with pytest.raises(FileNotFoundError, match="with --overwrite if the folder holds"):
        PPOTrainer(config, reward_model=reward).train(
            review_prompts(8, seed=0), resume_from="latest"
        )
    again = PPOTrainer(replace(config, overwrite_output_dir=True), reward_model=reward)
    again.train(review_prompts(8, seed=0))
    assert again.global_step == 2


def length_reward(prompts: list[str], completions: list[str]) -> list[float]:
    return [float(len(c)) for c in completions]
