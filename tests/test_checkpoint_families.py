"""The checkpoints people have, as shipped: tokenizers with pad == EOS, no pad, several EOS ids,
an end-of-turn token that is not ``eos_token``, a BOS the tokenizer adds; configs written by
current transformers; 4-bit weights. Each family (fixtures/checkpoint_families.py) loads with the
right values, runs SFT -> reward model -> PPO and GRPO, and chat responses end at the end of the
turn."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, Literal, cast

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

from base_setup.lora_setup import LoraSettings
from base_setup.tokenizer_setup import (
    chat_template_text,
    encode_text,
    end_of_turn_token_id,
    eos_token_ids,
)
from config.ppo_config import PPOConfig
from config.reward_config import RewardConfig
from config.sft_config import SFTConfig
from experience_buffer.buffer import RolloutBatch
from fixtures.checkpoint_families import FAMILIES, build_family_checkpoint, quantize_checkpoint
from models.checkpoint_config import check_config_is_read, config_updates
from models.policy_model import PolicyModel
from models.reward_model import RewardModel
from fixtures.tiny_corpus import lexicon_score, review_corpus, review_prompts
from ppo_trainer.callbacks import TrainerCallback
from ppo_trainer.ppo_trainer import PPOTrainer
from finetune.tokenize import tokenize_preferences
from finetune.reward_trainer import run_reward_training
from finetune.sft_trainer import run_sft

FAMILY_NAMES = sorted(FAMILIES)


@pytest.fixture(scope="session")
def family_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("families")
    return {name: build_family_checkpoint(root / name, name) for name in FAMILY_NAMES}


@pytest.fixture(scope="session")
def quantized_dir(family_dirs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    return quantize_checkpoint(family_dirs["smollm2"], tmp_path_factory.mktemp("q4") / "smollm2")


def flat(tree: Any) -> dict[str, np.ndarray]:
    return {k: np.array(v) for k, v in cast(list[tuple[str, Any]], tree_flatten(tree))}


def assert_all_changed(before: dict[str, np.ndarray], after: dict[str, np.ndarray]) -> None:
    assert before and before.keys() == after.keys()
    unchanged = [k for k in before if np.array_equal(before[k], after[k])]
    assert not unchanged, f"parameters not updated: {unchanged[:5]}"


def token(tokenizer: Any, text: str) -> int:
    return int(tokenizer.convert_tokens_to_ids(text))


# --------------------------------------------------------------------------- as shipped


def test_each_family_ships_what_it_claims(family_dirs: dict[str, Path]) -> None:
    """The fixtures reproduce the real configurations (else the tests below prove nothing)."""
    configs = {n: json.loads((d / "config.json").read_text()) for n, d in family_dirs.items()}
    tok_configs = {
        n: json.loads((d / "tokenizer_config.json").read_text()) for n, d in family_dirs.items()
    }
    smol = tok_configs["smollm2"]
    assert smol["pad_token"] == smol["eos_token"] == "<|im_end|>"
    assert "rope_theta" not in configs["smollm2"]
    assert configs["smollm2"]["rope_parameters"]["rope_theta"] == 100000.0
    assert tok_configs["qwen2_base"]["eos_token"] == "<|endoftext|>"
    assert "<|im_end|>" in tok_configs["qwen2_base"]["chat_template"]
    generation = json.loads((family_dirs["qwen3_chat"] / "generation_config.json").read_text())
    assert len(generation["eos_token_id"]) == 2
    for name in ("mistral", "gpt2"):
        assert tok_configs[name]["pad_token"] is None
    assert "n_ctx" not in configs["gpt2"]  # transformers 5 dropped it; mlx-lm requires it


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_tokenizer_is_usable_as_shipped(family_dirs: dict[str, Path], family: str) -> None:
    policy = PolicyModel.from_pretrained(family_dirs[family])
    tok = policy.tokenizer
    vocab_size = policy.config["vocab_size"]
    ends = eos_token_ids(tok)
    assert tok.pad_token_id is not None and 0 <= tok.pad_token_id < vocab_size
    assert len(tok) <= vocab_size  # nothing added to the vocabulary
    if family == "smollm2":
        assert tok.pad_token_id == token(tok, "<|im_end|>") and ends == [tok.pad_token_id]
        assert len(tok) == vocab_size  # a full vocabulary
    elif family in ("qwen2_base", "qwen3_chat"):
        # The template's end-of-turn token ends responses, whatever eos_token says.
        assert end_of_turn_token_id(tok) == token(tok, "<|im_end|>")
        assert ends == sorted({token(tok, "<|im_end|>"), token(tok, "<|endoftext|>")})
        assert tok.pad_token_id == token(tok, "<|endoftext|>")  # pad is an EOS id
    elif family == "mistral":
        assert tok.pad_token_id == token(tok, "</s>") == end_of_turn_token_id(tok)
        bos = token(tok, "<s>")
        assert encode_text(tok, "Review of the camera:")[0] == bos
        chat = chat_template_text(tok, [{"role": "user", "content": "Hi"}])
        ids = encode_text(tok, chat)
        assert ids[0] == bos and ids[1] != bos  # the template's BOS, not a second one
    elif family == "gpt2":
        assert tok.pad_token_id == tok.eos_token_id == vocab_size - 1
        assert end_of_turn_token_id(tok) is None


def test_mlx_lm_alone_misreads_a_current_transformers_config(family_dirs: dict[str, Path]) -> None:
    """The hazard the config fix removes: mlx-lm reads RoPE's base from the top level only."""
    from mlx_lm.utils import load_model

    model, _ = load_model(family_dirs["smollm2"])
    assert model.args.rope_theta == 10000  # silently the default, not the trained 100000
    ours = PolicyModel.from_pretrained(family_dirs["smollm2"])
    assert ours.model.args.rope_theta == 100000.0
    ids = mx.array([[5, 17, 33, 41, 60, 2, 9]])
    assert not np.allclose(np.array(model(ids)), np.array(ours(ids)), atol=1e-3)


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_logits_equal_transformers(family_dirs: dict[str, Path], family: str) -> None:
    torch = pytest.importorskip("torch")
    from transformers import AutoModelForCausalLM

    policy = PolicyModel.from_pretrained(family_dirs[family], dtype="float32")
    reference = AutoModelForCausalLM.from_pretrained(family_dirs[family], dtype=torch.float32)
    reference.eval()
    ids = encode_text(policy.tokenizer, "Review of the camera: The battery lasts all day.")
    ours = np.array(policy(mx.array([ids])))
    with torch.no_grad():
        theirs = reference(torch.tensor([ids])).logits.numpy()
    np.testing.assert_allclose(ours, theirs, atol=1e-4, rtol=1e-4)


def test_config_updates_lift_rope_parameters() -> None:
    assert config_updates({"rope_parameters": {"rope_theta": 5e5, "rope_type": "default"}}) == {
        "rope_theta": 5e5
    }
    scaled = {"rope_theta": 5e5, "rope_type": "linear", "factor": 4.0}
    assert config_updates({"rope_parameters": scaled}) == {
        "rope_theta": 5e5,
        "rope_scaling": {"rope_type": "linear", "factor": 4.0},
    }
    # A top-level value wins; per-layer-type sections are left to the check.
    assert config_updates({"rope_theta": 1e4, "rope_parameters": {"rope_theta": 5e5}}) == {}
    per_type = {"full_attention": {"rope_theta": 1e6}, "sliding_attention": {"rope_theta": 1e4}}
    assert config_updates({"rope_parameters": per_type}) == {}
    assert config_updates({"model_type": "gpt2", "n_positions": 64}) == {"n_ctx": 64}


def test_a_config_the_model_would_misread_is_refused() -> None:
    from mlx_lm.models import gpt2, llama

    base = dict(
        model_type="llama",
        hidden_size=64,
        num_hidden_layers=1,
        intermediate_size=128,
        num_attention_heads=4,
        rms_norm_eps=1e-6,
        vocab_size=100,
    )
    # A value present only in a nested section mlx-lm does not read.
    config = {**base, "rope_parameters": {"full_attention": {"rope_theta": 5e5}}}
    with pytest.raises(ValueError, match="rope_theta=500000.0 only under rope_parameters"):
        check_config_is_read(config, llama.ModelArgs.from_dict(config), "ckpt")
    # The same nested value, equal to what the model uses, is fine.
    config = {**base, "rope_parameters": {"full_attention": {"rope_theta": 10000}}}
    check_config_is_read(config, llama.ModelArgs.from_dict(config), "ckpt")
    # A setting that changes the function but that the architecture has no field for.
    config = dict(
        model_type="gpt2",
        n_ctx=64,
        n_embd=64,
        n_head=4,
        n_layer=1,
        n_positions=64,
        layer_norm_epsilon=1e-5,
        vocab_size=100,
        rope_scaling={"rope_type": "linear", "factor": 2.0},
    )
    with pytest.raises(ValueError, match="rope_scaling"):
        check_config_is_read(config, gpt2.ModelArgs.from_dict(config), "ckpt")
    check_config_is_read({**config, "rope_scaling": None}, gpt2.ModelArgs.from_dict(config), "c")


# --------------------------------------------------------------------------- the pipeline


def chat_or_text(family: str) -> bool:
    return FAMILIES[family].chat_template is not None


def sft_records(family: str, n: int) -> list[dict[str, Any]]:
    """Short reviews: chat turns where the tokenizer has a template, else prompt/completion."""
    records: list[dict[str, Any]] = []
    for review in review_corpus(n, seed=1):
        prompt, _, body = review.text.partition(": ")
        answer = body.split(". ")[0].rstrip(".") + "."
        if chat_or_text(family):
            messages = [
                {"role": "user", "content": prompt + ":"},
                {"role": "assistant", "content": answer},
            ]
            records.append({"messages": messages})
        else:
            records.append({"prompt": prompt + ":", "completion": " " + answer})
    return records


def preference_records(family: str, n: int) -> list[dict[str, Any]]:
    """Pairs preferring the more positive of two reviews of the same item."""
    reviews = review_corpus(3 * n, seed=2)
    by_item: dict[str, list[Any]] = {}
    for review in reviews:
        by_item.setdefault(review.text.partition(": ")[0], []).append(review)
    pairs = []
    for item, group in by_item.items():
        ranked = sorted(group, key=lambda r: lexicon_score(r.text))
        if len(ranked) < 2 or lexicon_score(ranked[0].text) == lexicon_score(ranked[-1].text):
            continue
        chosen = ranked[-1].text.partition(": ")[2]
        rejected = ranked[0].text.partition(": ")[2]
        if chat_or_text(family):
            prompt: Any = [{"role": "user", "content": item + ":"}]
            pairs.append({"prompt": prompt, "chosen": chosen, "rejected": rejected})
        else:
            pairs.append({"prompt": item + ":", "chosen": " " + chosen, "rejected": " " + rejected})
    return pairs[:n]


def write_jsonl(path: Path, records: list[dict[str, Any]]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return str(path)


def ppo_prompts(family: str, n: int) -> list[Any]:
    items = [r.text.partition(": ")[0] + ":" for r in review_corpus(n, seed=3)]
    if chat_or_text(family):
        return [[{"role": "user", "content": item}] for item in items]
    return items


class EndsAtTheTurn(TrainerCallback):
    """Checks every rollout: a response's last action token is its first end token, nothing
    after it is an action, and the score is read at that token (the reward model's score of
    the sequence cut right after it, alone, unpadded)."""

    def __init__(self) -> None:
        self.ended = 0

    def on_rollout_end(self, trainer: Any, step: int, batch: RolloutBatch) -> None:
        stops = set(trainer.stop_token_ids)
        responses = np.array(batch.responses)
        mask = np.array(batch.mask)
        query_responses = np.array(batch.query_responses)
        prompt_lengths = np.array(batch.prompt_lengths)
        scores = np.array(batch.scores)
        for b, (row, row_mask) in enumerate(zip(responses, mask)):
            length = int(row_mask.sum())
            assert row_mask[:length].all() and not row_mask[length:].any()
            assert not stops & set(row[: length - 1].tolist())  # no end before the last
            if row[length - 1] in stops:
                self.ended += 1
            end = int(prompt_lengths[b]) + length
            alone = mx.array(query_responses[b : b + 1, :end])
            expected = float(np.array(trainer.reward_model.score(alone, [end]))[0])
            np.testing.assert_allclose(scores[b], expected, atol=1e-4, rtol=1e-4)


def run_pipeline(model_dir: Path, family: str, out: Path, *, sft_lora: bool = False) -> None:
    sft_dir = run_sft(
        SFTConfig(
            model_name=str(model_dir),
            dataset=write_jsonl(out / "sft.jsonl", sft_records(family, 48)),
            output_dir=str(out / "sft"),
            use_lora=sft_lora,
            lora_r=4,
            learning_rate=1e-2 if sft_lora else 3e-3,
            batch_size=8,
            num_epochs=2,
            lr_scheduler="constant",
            eval_fraction=0.0,
            progress_bar=False,
        )
    )
    base = PolicyModel.from_pretrained(model_dir)
    tuned = PolicyModel.from_pretrained(sft_dir)
    if sft_lora:
        # Adapters merged into the weights (re-quantized for a quantized base, as mlx_lm.fuse
        # does): the function moved, the format stayed.
        assert tuned.is_quantized == base.is_quantized
        ids = mx.array([encode_text(base.tokenizer, "Review of the camera:")])
        assert not np.allclose(np.array(base(ids)), np.array(tuned(ids)), atol=1e-3)
    else:
        assert_all_changed(flat(base.model.parameters()), flat(tuned.model.parameters()))
    policy_dir = sft_dir

    reward_dir = run_reward_training(
        RewardConfig(
            model_name=str(policy_dir),
            dataset=write_jsonl(out / "pref.jsonl", preference_records(family, 24)),
            output_dir=str(out / "reward"),
            learning_rate=1e-3,
            batch_size=8,
            lr_scheduler="constant",
            eval_fraction=0.0,
            progress_bar=False,
        )
    )
    reward = RewardModel.from_pretrained(reward_dir)
    assert np.abs(np.array(reward.head.weight)).sum() > 0

    prompts = ppo_prompts(family, 8)
    algorithms: tuple[Literal["ppo", "grpo"], ...] = ("ppo", "grpo")
    for algorithm in algorithms:
        config = PPOConfig(
            model_name=str(policy_dir),
            reward_model_name=str(reward_dir),
            algorithm=algorithm,
            group_size=2 if algorithm == "grpo" else 1,
            batch_size=4,
            max_new_tokens=12,
            learning_rate=3e-3,
            num_ppo_epochs=1,
            lora_r=4,
            total_steps=2,
            output_dir=str(out / algorithm),
            progress_bar=False,
        )
        trainer = PPOTrainer(config)
        checker = EndsAtTheTurn()
        policy_before = flat(trainer.policy.trainable_parameters())
        value_before = (
            flat(trainer.value_model.trainable_parameters()) if trainer.value_model else {}
        )
        trainer.train(prompts, callbacks=[checker])
        assert_all_changed(policy_before, flat(trainer.policy.trainable_parameters()))
        if trainer.value_model is not None:
            assert_all_changed(value_before, flat(trainer.value_model.trainable_parameters()))
        if chat_or_text(family):
            # After SFT on chat turns the policy ends its turns: the responses stop there.
            assert checker.ended > 0


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_sft_reward_ppo_grpo_on_each_family(
    family_dirs: dict[str, Path], family: str, tmp_path: Path
) -> None:
    run_pipeline(family_dirs[family], family, tmp_path)


def test_chat_preferences_are_scored_where_ppo_stops(family_dirs: dict[str, Path]) -> None:
    """A conversational preference pair is tokenised as PPO generates: the prompt with its
    generation header, the reply, the end-of-turn token, and nothing after it."""
    policy = PolicyModel.from_pretrained(family_dirs["qwen2_base"])
    tok = policy.tokenizer
    prompt = [{"role": "user", "content": "Review of the camera:"}]
    (pair,) = tokenize_preferences(
        [{"prompt": prompt, "chosen": "Superb.", "rejected": "Awful."}], tok, 64
    )
    context = encode_text(tok, chat_template_text(tok, prompt))
    assert pair.chosen_ids[: len(context)] == context
    assert pair.chosen_ids[-1] == token(tok, "<|im_end|>")  # not the template's "\n" after it
    assert pair.chosen_ids[len(context) : -1] == encode_text(tok, "Superb.")


# --------------------------------------------------------------------------- 4-bit (QLoRA)


@pytest.mark.slow
def test_quantized_model_trains_lora_under_sft_ppo_grpo(
    family_dirs: dict[str, Path], quantized_dir: Path, tmp_path: Path
) -> None:
    policy = PolicyModel.from_pretrained(quantized_dir)
    assert policy.is_quantized
    run_pipeline(quantized_dir, "smollm2", tmp_path, sft_lora=True)


def test_quantized_reference_is_the_base_with_adapters_off(
    quantized_dir: Path, tmp_path: Path
) -> None:
    config = PPOConfig(
        model_name=str(quantized_dir),
        max_new_tokens=6,
        batch_size=2,
        lora_r=4,
        learning_rate=1e-2,
        num_ppo_epochs=1,
        output_dir=str(tmp_path / "run"),
        progress_bar=False,
    )
    trainer = PPOTrainer(config, reward_model=lambda p, c: [float(len(x)) for x in c])
    assert trainer.ref_model is not None
    assert trainer.ref_model.shares_policy_weights and trainer.policy.is_quantized
    ids = mx.array([[5, 17, 33, 41]])
    positions = mx.array([[1, 2, 3]])
    base = np.array(trainer.ref_model.logits_at(ids, positions))
    trainer.step(["Review of the camera:", "Review of the laptop:"])
    # The adapters moved the policy; the reference is still the quantized base.
    assert not np.allclose(np.array(trainer.policy.logits_at(ids, positions)), base, atol=1e-5)
    np.testing.assert_array_equal(np.array(trainer.ref_model.logits_at(ids, positions)), base)


def test_adapters_over_a_base_mlx_lm_misreads_say_how_to_use_them(
    family_dirs: dict[str, Path], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """SmolLM2's config keeps rope_theta under rope_parameters: mlx-lm alone, given the base and
    the adapters, builds another model. Saving the adapters says so and names the way out."""
    lora = LoraSettings(r=2, alpha=4.0, dropout=0.0)
    with caplog.at_level("WARNING", logger="ppo_mlx"):
        qwen2 = PolicyModel.from_pretrained(family_dirs["qwen2_base"], lora=lora)
        qwen2.save_pretrained(tmp_path / "qwen2")  # a top-level rope_theta: mlx-lm reads it
    assert not caplog.records
    with caplog.at_level("WARNING", logger="ppo_mlx"):
        smol = PolicyModel.from_pretrained(family_dirs["smollm2"], lora=lora)
        smol.save_pretrained(tmp_path / "smol")
    (record,) = caplog.records
    message = record.getMessage()
    assert "rope_theta" in message and "main.py export ADAPTERS --out DIR --fuse" in message


def test_full_training_of_a_quantized_model_is_refused(quantized_dir: Path, tmp_path: Path) -> None:
    config = PPOConfig(model_name=str(quantized_dir), use_lora=False, output_dir=str(tmp_path))
    with pytest.raises(ValueError, match="quantized.*use_lora: true"):
        PPOTrainer(config, reward_model=lambda p, c: [0.0] * len(c))


# --------------------------------------------------------------------------- exported reward


def test_exported_reward_model_is_scored_on_the_last_real_token(
    family_dirs: dict[str, Path], tmp_path: Path
) -> None:
    """pad == EOS (SmolLM2): transformers must score the EOS, not the token before it."""
    torch = pytest.importorskip("torch")
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    source = family_dirs["smollm2"]
    tok = PolicyModel.from_pretrained(source).tokenizer
    reward = RewardModel.from_causal_lm(source, head_init="normal", seed=3)
    out = reward.save_pretrained(tmp_path / "rm", tokenizer=tok)
    saved = json.loads((out / "config.json").read_text())
    assert saved["pad_token_id"] not in eos_token_ids(tok)

    eos = tok.eos_token_id
    texts = ["Review of the camera: superb.", "Review of the sushi bar: The fish was fresh."]
    rows = [encode_text(tok, t) + [eos] for t in texts]
    lengths = [len(r) for r in rows]
    width = max(lengths)
    ids = mx.array([r + [tok.pad_token_id] * (width - len(r)) for r in rows])
    ours = np.array(reward.score(ids, lengths))

    hf_tok = AutoTokenizer.from_pretrained(out)
    hf = AutoModelForSequenceClassification.from_pretrained(out, dtype=torch.float32).eval()
    batch = hf_tok.pad({"input_ids": rows}, return_tensors="pt")
    with torch.no_grad():
        theirs = hf(**batch).logits[:, 0].numpy()
    np.testing.assert_allclose(theirs, ours, atol=1e-4, rtol=1e-4)
    # Our loader reads the exported checkpoint back to the same scores.
    np.testing.assert_allclose(
        np.array(RewardModel.from_pretrained(out).score(ids, lengths)), ours, atol=1e-5
    )


def test_gpt2_reward_model_exports_in_transformers_layout(
    family_dirs: dict[str, Path], tmp_path: Path
) -> None:
    torch = pytest.importorskip("torch")
    from transformers import AutoModelForSequenceClassification

    source = family_dirs["gpt2"]
    tok = PolicyModel.from_pretrained(source).tokenizer
    reward = RewardModel.from_causal_lm(source, head_init="normal", seed=3)
    out = reward.save_pretrained(tmp_path / "rm", tokenizer=tok)
    rows = [encode_text(tok, "Review of the camera: superb.") + [tok.eos_token_id]]
    ours = np.array(reward.score(mx.array(rows), [len(rows[0])]))
    hf = AutoModelForSequenceClassification.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        theirs = hf(input_ids=torch.tensor(rows)).logits[:, 0].numpy()
    np.testing.assert_allclose(theirs, ours, atol=1e-4, rtol=1e-4)
    np.testing.assert_allclose(
        np.array(RewardModel.from_pretrained(out).score(mx.array(rows), [len(rows[0])])),
        ours,
        atol=1e-5,
    )


# --------------------------------------------------------------------------- plain prompts


def test_plain_prompts_get_the_chat_template_as_generate_gives_it(
    family_dirs: dict[str, Path], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from ppo_trainer.chat import encode_prompt, use_chat_template

    def brevity(completions: list[str], **kwargs: Any) -> list[float]:
        return [-float(len(c.split())) for c in completions]

    settings: dict[str, Any] = dict(
        model_name=str(family_dirs["smollm2"]),
        batch_size=2,
        max_new_tokens=4,
        output_dir=str(tmp_path / "run"),
        progress_bar=False,
    )
    with caplog.at_level(logging.INFO, logger="ppo_mlx"):
        trainer = PPOTrainer(PPOConfig(**settings), reward_model=brevity)
    assert "plain-text prompts go through the tokenizer's chat template" in caplog.text
    tokenizer = trainer.tokenizer
    text = trainer.format_prompt("Review of the lamp:")
    assert text.startswith("<|im_start|>user\nReview of the lamp:<|im_end|>")
    # the ids `generate` and `chat` send for the same prompt
    generate_ids = encode_prompt(
        tokenizer, "Review of the lamp:", chat=use_chat_template(tokenizer, None)
    )
    assert trainer.encode_prompt(text) == generate_ids

    plain = PPOTrainer(PPOConfig(**settings, use_chat_template=False), reward_model=brevity)
    assert plain.format_prompt("Review of the lamp:") == "Review of the lamp:"
    gpt2 = {**settings, "model_name": str(family_dirs["gpt2"])}
    assert PPOTrainer(PPOConfig(**gpt2), reward_model=brevity).chat_prompts is False
    with pytest.raises(ValueError, match="use_chat_template is true but the tokenizer"):
        PPOTrainer(PPOConfig(**gpt2, use_chat_template=True), reward_model=brevity)


def test_a_rollout_of_only_empty_responses_is_named(
    family_dirs: dict[str, Path], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    model_dir = family_dirs["smollm2"]
    vocab = int(json.loads((model_dir / "config.json").read_text())["vocab_size"])
    config = PPOConfig(
        model_name=str(model_dir),
        batch_size=2,
        max_new_tokens=4,
        stop_token_ids=list(range(vocab)),  # every first token ends the response
        output_dir=str(tmp_path / "run"),
        progress_bar=False,
    )
    trainer = PPOTrainer(config, reward_model=lambda p, c: [0.0] * len(c))
    with caplog.at_level(logging.WARNING, logger="ppo_mlx"):
        trainer.step(["Review of the lamp:", "Review of the park:"])
    assert "step 1: every response ended at once with a stop token" in caplog.text
    assert "use_chat_template (now auto)" in caplog.text


@pytest.mark.slow
def test_ppo_learns_a_reward_of_scale_minus_twenty_on_a_chat_checkpoint(
    family_dirs: dict[str, Path], tmp_path: Path
) -> None:
    """The first hour on a real chat checkpoint (pad == EOS, ChatML, plain prompts through the
    template): a reward of minus the length, around -20. With normalize_reward and a value
    warm-up, the mean score of the last 4 of 24 steps beats the first 4 by 10 for one of three
    seeds (seeds 0 and 1 gained about 20, seed 2 about 3; without normalize_reward one seed of
    the three learned at these settings, and none gained 5 under a linear schedule)."""

    def shorter(completions: list[str], **kwargs: Any) -> list[float]:
        return [-len(c) / 2.5 for c in completions]  # about -20 at 32 random tokens

    results = []
    for seed in (0, 1, 2):
        config = PPOConfig(
            model_name=str(family_dirs["smollm2"]),
            max_new_tokens=32,
            batch_size=8,
            learning_rate=1e-2,
            kl_coef=0.01,
            lr_scheduler="constant",
            num_ppo_epochs=4,
            temperature=1.0,
            normalize_reward=True,
            value_warmup_steps=1,
            total_steps=24,
            seed=seed,
            output_dir=str(tmp_path / f"seed{seed}"),
            progress_bar=False,
            log_rollouts_every=0,
            save_every=0,
        )
        trainer = PPOTrainer(config, reward_model=shorter)
        assert trainer.chat_prompts  # the checkpoint's template, by default
        history = trainer.train(review_prompts(8 * 24, seed=0))
        scores = [h["objective/scores"] for h in history]
        first, last = np.mean(scores[:4]), np.mean(scores[-4:])
        assert first < -15  # the scale of the real task
        results.append((seed, round(float(first), 2), round(float(last), 2)))
        if last > first + 10:
            return
    raise AssertionError(f"no seed raised the mean score by 10: {results}")
