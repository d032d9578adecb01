"""From a run to a model people use: resolving RUN_OR_DIR, generate / chat, and export.

Everything runs on locally built tiny models: a short PPO run with LoRA (its run directory,
final/ adapters and checkpoints), a short full-weight SFT run, the plain tiny checkpoint, and a
4-bit copy of it made with mlx-lm's quantisation. The reference for each path is mlx-lm itself
(``mlx_lm.load(base, adapter_path=...)``), so these tests check that our loading agrees with
what the mlx-lm command line gives.
"""

from __future__ import annotations

import importlib.util
import io
import json
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any, cast

import mlx.core as mx
import numpy as np
import pytest
import yaml
from mlx.utils import tree_flatten

import main
from base_setup.lora_setup import LoraSettings, adapter_base_model, lora_modules
from base_setup.tokenizer_setup import apply_chat_template
from config.loading import load_config
from config.ppo_config import PPOConfig
from config.sft_config import SFTConfig
from fixtures.checkpoint_families import FAMILIES, build_family_checkpoint, quantize_checkpoint
from fixtures.demo_data import write_sft_data
from models.policy_model import PolicyModel
from fixtures.tiny_corpus import review_prompts
from ppo_trainer import export as export_module
from ppo_trainer.chat import SamplingSettings, chat_session, generate_text, stream_reply
from ppo_trainer.export import TRANSFORMERS_LAYOUT, export_model
from ppo_trainer.ppo_trainer import PPOTrainer
from ppo_trainer.trained_model import load_trained_model, resolve_trained_model
from finetune.sft_trainer import run_sft

ROOT = Path(__file__).resolve().parent.parent
PROMPT = "Review of the camera:"
GREEDY = SamplingSettings(max_tokens=12, temperature=0.0)


def e_rate(prompts: list[str], completions: list[str]) -> list[float]:
    return [c.count("e") / max(len(c), 1) for c in completions]


@pytest.fixture(scope="module")
def ppo_run(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-step PPO run with LoRA: final/ (adapters), checkpoints/step_000001 and 000002."""
    run = tmp_path_factory.mktemp("ppo") / "run"
    config = PPOConfig(
        model_name=str(tiny_model_dir),
        max_new_tokens=8,
        batch_size=4,
        learning_rate=3e-2,  # large, so that the adapters move the logits visibly
        num_ppo_epochs=1,
        num_mini_batches=1,
        output_dir=str(run),
        progress_bar=False,
        total_steps=2,
        save_every=1,
        use_lora=True,
    )
    trainer = PPOTrainer(config, reward_model=e_rate)
    trainer.train(review_prompts(8, seed=0), num_epochs=1)
    trainer.save_model(run / "final")
    return run


@pytest.fixture(scope="module")
def sft_run(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-step full-weight SFT run: model/ and checkpoints/step_000001, step_000002."""
    root = tmp_path_factory.mktemp("sft")
    config = SFTConfig(
        model_name=str(tiny_model_dir),
        dataset=str(write_sft_data(root / "sft.jsonl", 32, seed=0)),
        output_dir=str(root / "run"),
        learning_rate=1e-2,
        batch_size=8,
        total_steps=2,
        save_every=1,
        eval_fraction=0.0,
        progress_bar=False,
    )
    run_sft(config)
    return root / "run"


@pytest.fixture(scope="module")
def quantized_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model in mlx-lm's 4-bit format (every linear layer's input size is a multiple of
    64, so each is quantized with mlx-lm's default group size)."""
    from mlx_lm import load
    from mlx_lm.utils import quantize_model, save

    out = tmp_path_factory.mktemp("q4") / "model"
    loaded: Any = load(str(tiny_model_dir), return_config=True)
    model, tokenizer, config = loaded
    model, config = quantize_model(model, config, group_size=64, bits=4)
    save(out, tiny_model_dir, model, tokenizer, config)
    assert json.loads((out / "config.json").read_text())["quantization"]["bits"] == 4
    return out


def logits(model: Any, tokenizer: Any, text: str = PROMPT) -> np.ndarray:
    ids = tokenizer.encode(text, add_special_tokens=False)
    return np.array(model(mx.array([ids]))[0].astype(mx.float32))


def mlx_load(base: Path, adapters: Path | None = None) -> tuple[Any, Any]:
    """What ``mlx_lm.generate --model base [--adapter-path adapters]`` loads."""
    from mlx_lm import load

    loaded: Any = load(str(base), adapter_path=None if adapters is None else str(adapters))
    return loaded[0], loaded[1]


def mlx_lm_greedy(model: Any, tokenizer: Any, prompt: str = PROMPT, max_tokens: int = 12) -> str:
    from mlx_lm import generate

    return str(generate(model, tokenizer, prompt, max_tokens=max_tokens))


def ours(path: Path) -> PolicyModel:
    return load_trained_model(resolve_trained_model(path))


# --------------------------------------------------------------------------- resolving


@pytest.mark.slow
def test_saved_adapters_record_their_base_model(ppo_run: Path, tiny_model_dir: Path) -> None:
    config = json.loads((ppo_run / "final" / "adapter_config.json").read_text())
    assert config["model"] == str(tiny_model_dir.resolve())
    assert adapter_base_model(ppo_run / "final") == str(tiny_model_dir.resolve())
    # A Hub id is kept as the user gave it (not the local cache path it was read from).
    policy = PolicyModel.from_pretrained(tiny_model_dir, lora=LoraSettings(r=2, alpha=4, dropout=0))
    hub_named = PolicyModel(
        policy.model,
        policy.tokenizer,
        model_path=policy.model_path,
        config=policy.config,
        lora=policy.lora,
        name_or_path="Qwen/Qwen3-0.6B",
    )
    out = hub_named.save_pretrained(tiny_model_dir.parent / "hub_adapters")
    assert json.loads((out / "adapter_config.json").read_text())["model"] == "Qwen/Qwen3-0.6B"
    assert adapter_base_model(out) == "Qwen/Qwen3-0.6B"


@pytest.mark.slow
def test_every_path_of_a_run_resolves(ppo_run: Path, sft_run: Path, tiny_model_dir: Path) -> None:
    # PPO runs write their config as SFT runs do; config.load_config reads it back.
    assert load_config(ppo_run / "config.yaml").model_name == str(tiny_model_dir)
    base = str(tiny_model_dir.resolve())
    for path in (ppo_run, ppo_run / "final"):
        found = resolve_trained_model(path)
        assert (found.kind, found.path, found.base_model) == ("adapters", ppo_run / "final", base)
        assert found.run_dir == ppo_run and found.algorithm == "ppo"
        assert found.run_config is not None and found.run_config["lora_r"] == 8
        assert found.final_metrics is not None and found.final_metrics["step"] == 2
    step1 = resolve_trained_model(ppo_run / "checkpoints" / "step_000001")
    assert (step1.kind, step1.base_model, step1.run_dir) == (
        "checkpoint",
        str(tiny_model_dir),
        ppo_run,
    )
    assert step1.lora == LoraSettings(r=8, alpha=16.0, dropout=0.0)
    assert step1.final_metrics is not None and step1.final_metrics["step"] == 1
    plain = resolve_trained_model(tiny_model_dir)
    assert (plain.kind, plain.adapter_dir, plain.run_dir) == ("model", None, None)
    sft = resolve_trained_model(sft_run)
    assert (sft.kind, sft.path, sft.algorithm) == ("model", sft_run / "model", "sft")


def test_run_without_final_uses_its_newest_checkpoint(ppo_run: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    shutil.copytree(ppo_run, run, ignore=shutil.ignore_patterns("final"))
    found = resolve_trained_model(run)
    assert (found.kind, found.path) == ("checkpoint", run / "checkpoints" / "step_000002")


# --------------------------------------------------------------------------- generate


@pytest.mark.slow
def test_greedy_generation_matches_mlx_lm_from_every_path(
    ppo_run: Path, sft_run: Path, tiny_model_dir: Path
) -> None:
    # The LoRA run: mlx_lm.load(base, adapter_path=final) is the reference.
    ref_model, ref_tokenizer = mlx_load(tiny_model_dir, ppo_run / "final")
    ref_text = mlx_lm_greedy(ref_model, ref_tokenizer)
    ref_logits = logits(ref_model, ref_tokenizer)
    base_model, base_tokenizer = mlx_load(tiny_model_dir)
    assert not np.allclose(ref_logits, logits(base_model, base_tokenizer), atol=1e-3)  # trained
    step2 = ppo_run / "checkpoints" / "step_000002"  # the same weights as final/
    for path in (ppo_run, ppo_run / "final", step2):
        policy = ours(path)
        np.testing.assert_allclose(logits(policy.model, policy.tokenizer), ref_logits, atol=1e-5)
        text = generate_text(policy.model, policy.tokenizer, PROMPT, GREEDY, chat=False)
        assert text == ref_text, path
    step1 = ours(ppo_run / "checkpoints" / "step_000001")
    assert not np.allclose(logits(step1.model, step1.tokenizer), ref_logits, atol=1e-4)

    # The full-weight SFT run: its checkpoint holds every weight; model/ is the same model.
    sft_model, sft_tokenizer = mlx_load(sft_run / "model")
    sft_ref = logits(sft_model, sft_tokenizer)
    for path in (sft_run, sft_run / "checkpoints" / "step_000002"):
        policy = ours(path)
        np.testing.assert_allclose(logits(policy.model, policy.tokenizer), sft_ref, atol=1e-5)

    # A plain model directory.
    policy = ours(tiny_model_dir)
    text = generate_text(policy.model, policy.tokenizer, PROMPT, GREEDY, chat=False)
    assert text == mlx_lm_greedy(base_model, base_tokenizer)


def test_generate_command_prints_the_completion(
    ppo_run: Path, tiny_model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["generate", "--model", str(ppo_run), "--prompt", PROMPT, "--no-chat"]
    assert main.main(argv + ["--temperature", "0", "--max-tokens", "12"]) == 0
    ref_model, ref_tokenizer = mlx_load(tiny_model_dir, ppo_run / "final")
    assert capsys.readouterr().out == mlx_lm_greedy(ref_model, ref_tokenizer) + "\n"
    # The chat template is applied by default (the tiny tokenizer has one): another prompt.
    assert main.main(argv[:-1] + ["--temperature", "0", "--max-tokens", "12"]) == 0
    policy = ours(ppo_run)
    chat_text = generate_text(policy.model, policy.tokenizer, PROMPT, GREEDY, chat=True)
    assert capsys.readouterr().out == chat_text + "\n"
    # Sampling is seeded: the same seed, the same text.
    settings = SamplingSettings(max_tokens=8, temperature=1.0, top_p=0.9, seed=3)
    sampled = [generate_text(policy.model, policy.tokenizer, PROMPT, settings) for _ in range(2)]
    assert sampled[0] == sampled[1]


class _Recorder(io.StringIO):
    def __init__(self) -> None:
        super().__init__()
        self.writes: list[str] = []

    def write(self, s: str) -> int:
        self.writes.append(s)
        return super().write(s)


def test_chat_keeps_the_history_streams_and_resets(ppo_run: Path) -> None:
    policy = ours(ppo_run)
    stdin = io.StringIO("Hello there\nTell me more\n/reset\nAgain\n/exit\nnever read\n")
    stdout = _Recorder()
    settings = SamplingSettings(max_tokens=6, temperature=0.0)
    messages = chat_session(policy.model, policy.tokenizer, settings, stdin=stdin, stdout=stdout)
    assert [m["role"] for m in messages] == ["user", "assistant"]
    assert messages[0]["content"] == "Again"
    # The second turn was answered with the first turn in its prompt: the same reply as a
    # conversation built by hand, which differs from the reply to the second message alone.
    first = generate_text(policy.model, policy.tokenizer, "Hello there", settings, chat=True)
    history = [
        {"role": "user", "content": "Hello there"},
        {"role": "assistant", "content": first},
        {"role": "user", "content": "Tell me more"},
    ]
    second = "".join(
        stream_reply(
            policy.model, policy.tokenizer, apply_chat_template(policy.tokenizer, history), settings
        )
    )
    text = stdout.getvalue()
    assert f"> {first}\n" in text and f"> {second}\n" in text
    # Streamed: each reply reached stdout in several pieces, as they were generated.
    assert sum(1 for w in stdout.writes if w and w in first) >= 3


@pytest.mark.slow
def test_chat_command_in_a_subprocess(ppo_run: Path) -> None:
    cmd = [sys.executable, "main.py", "chat", "--model", str(ppo_run), "--show-prompt"]
    result = subprocess.run(
        cmd + ["--max-tokens", "6", "--temperature", "0"],
        input="Hello there\nTell me more\n/exit\n",
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    prompts = result.stdout.split("[prompt]\n")[1:]
    assert len(prompts) == 2
    first_prompt, first_reply = prompts[0].split("[/prompt]\n")
    second_prompt = prompts[1].split("[/prompt]\n")[0]
    first_reply = first_reply.split("\n\n> ")[0]
    assert "Hello there" in first_prompt and "Tell me more" not in first_prompt
    # The second turn's prompt holds the whole first turn (history), then the new message.
    assert second_prompt.startswith(first_prompt + first_reply)
    assert second_prompt.rstrip().endswith("assistant") and "Tell me more" in second_prompt


@pytest.mark.slow
def test_sigterm_ends_a_chat_with_143(ppo_run: Path) -> None:
    """SIGTERM (docker stop, a scheduler) while chat waits for input ended it with exit 0, as if
    the user had typed /exit; now as every command: "interrupted (SIGTERM)", exit 143."""
    cmd = [sys.executable, "main.py", "chat", "--model", str(ppo_run)]
    proc = subprocess.Popen(
        cmd, cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    assert proc.stdout is not None
    seen = b""
    while not seen.endswith(b"> "):  # the help text, then the first input prompt
        piece = proc.stdout.read1(1024)  # type: ignore[attr-defined]
        assert piece, f"chat ended early: {proc.communicate()[1].decode()}"
        seen += piece
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 143 and b"interrupted (SIGTERM)" in err


def test_chat_needs_a_chat_template(tmp_path: Path, tiny_model_dir: Path) -> None:
    plain = tmp_path / "no_template"
    shutil.copytree(tiny_model_dir, plain)
    config = json.loads((plain / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (plain / "tokenizer_config.json").write_text(json.dumps(config))
    policy = ours(plain)
    with pytest.raises(ValueError, match="no chat template"):
        chat_session(
            policy.model, policy.tokenizer, GREEDY, stdin=io.StringIO(""), stdout=io.StringIO()
        )
    with pytest.raises(ValueError, match="--no-chat"):
        generate_text(policy.model, policy.tokenizer, PROMPT, GREEDY, chat=True)
    # Without a template the default sends the text as it is.
    assert generate_text(policy.model, policy.tokenizer, PROMPT, GREEDY) == generate_text(
        policy.model, policy.tokenizer, PROMPT, GREEDY, chat=False
    )


# --------------------------------------------------------------------------- export


def test_export_fused_loads_in_mlx_lm_with_the_same_logits_and_a_model_card(
    ppo_run: Path, tmp_path: Path, tiny_model_dir: Path
) -> None:
    out = export_model(ppo_run, tmp_path / "fused", fuse=True)
    assert not (out / "adapters").exists()
    ref_model, ref_tokenizer = mlx_load(tiny_model_dir, ppo_run / "final")
    model, tokenizer = mlx_load(out)
    assert not lora_modules(model)
    np.testing.assert_allclose(
        logits(model, tokenizer), logits(ref_model, ref_tokenizer), atol=1e-5
    )
    assert mlx_lm_greedy(model, tokenizer) == mlx_lm_greedy(ref_model, ref_tokenizer)
    # Stop ids include the chat end-of-turn token; the chat template travels with the tokenizer.
    generation = json.loads((out / "generation_config.json").read_text())
    assert generation["eos_token_id"] == [0, 3]
    assert tokenizer.eos_token_ids == {0, 3} and tokenizer.has_chat_template

    card = (out / "README.md").read_text()
    assert f"**Base model:** `{tiny_model_dir.resolve()}`" in card
    assert "PPO" in card and "fused into the weights" in card
    assert f"mlx_lm.generate --model {out} --prompt" in card
    config_yaml = card.split("```yaml\n")[1].split("```")[0]
    assert yaml.safe_load(config_yaml)["lora_r"] == 8
    last = json.loads((ppo_run / "metrics.jsonl").read_text().splitlines()[-1])
    assert "## Final metrics (step 2)" in card and f"{last['objective/kl']:.6g}" in card

    # Our own tools read the export too.
    policy = ours(out)
    np.testing.assert_allclose(logits(policy.model, policy.tokenizer), logits(model, tokenizer))


def test_export_unfused_keeps_adapters_beside_the_base(
    ppo_run: Path, tmp_path: Path, tiny_model_dir: Path
) -> None:
    out = export_model(ppo_run / "final", tmp_path / "unfused")
    assert (out / "adapters" / "adapters.safetensors").is_file()
    base_model, base_tokenizer = mlx_load(out)  # mlx-lm alone reads the base model
    ref_base, ref_tokenizer = mlx_load(tiny_model_dir)
    np.testing.assert_allclose(logits(base_model, base_tokenizer), logits(ref_base, ref_tokenizer))
    adapted, tokenizer = mlx_load(out, out / "adapters")
    trained, _ = mlx_load(tiny_model_dir, ppo_run / "final")
    np.testing.assert_allclose(logits(adapted, tokenizer), logits(trained, tokenizer), atol=1e-6)
    assert f"--adapter-path {out}/adapters" in (out / "README.md").read_text()
    # generate / chat on the export apply its adapters; fused and unfused agree.
    found = resolve_trained_model(out)
    assert found.adapter_dir == out / "adapters"
    assert adapter_base_model(out / "adapters") == str(out.resolve())
    policy = load_trained_model(found)
    fused = export_model(out, tmp_path / "fused_from_unfused", fuse=True)
    fused_model, _ = mlx_load(fused)
    np.testing.assert_allclose(
        logits(policy.model, tokenizer), logits(fused_model, tokenizer), atol=1e-5
    )


def test_export_of_a_checkpoint_and_of_an_sft_run(
    ppo_run: Path, sft_run: Path, tmp_path: Path
) -> None:
    step1 = ppo_run / "checkpoints" / "step_000001"
    out = export_model(step1, tmp_path / "step1", fuse=True)
    model, tokenizer = mlx_load(out)
    policy = ours(step1)
    np.testing.assert_allclose(
        logits(model, tokenizer), logits(policy.model, policy.tokenizer), atol=1e-5
    )
    assert "## Final metrics (step 1)" in (out / "README.md").read_text()

    out = export_model(sft_run, tmp_path / "sft")
    card = (out / "README.md").read_text()
    assert "supervised fine-tuning" in card and "all weights trained" in card
    model, tokenizer = mlx_load(out)
    ref, _ = mlx_load(sft_run / "model")
    np.testing.assert_allclose(logits(model, tokenizer), logits(ref, tokenizer))


def test_a_checkpoint_of_every_algorithm_without_a_value_model_loads_and_exports(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """An RLOO checkpoint holds the policy as PPO's and GRPO's do (loading one looked for an SFT
    run's weights before, and failed); the model card names its algorithm."""
    config = PPOConfig(
        model_name=str(tiny_model_dir),
        algorithm="rloo",
        group_size=2,
        batch_size=2,
        max_new_tokens=4,
        num_ppo_epochs=1,
        learning_rate=3e-2,
        output_dir=str(tmp_path / "run"),
        progress_bar=False,
        total_steps=1,
        save_every=1,
        use_lora=True,
        log_rollouts_every=0,
    )
    trainer = PPOTrainer(config, reward_model=e_rate)
    trainer.train(review_prompts(2, seed=0), num_epochs=1)
    step1 = tmp_path / "run" / "checkpoints" / "step_000001"
    policy = ours(step1)
    np.testing.assert_allclose(
        logits(policy.model, policy.tokenizer), logits(trainer.policy.model, policy.tokenizer)
    )
    out = export_model(step1, tmp_path / "export", fuse=True)
    assert "- **Training:** RLOO (`algorithm: rloo`" in (out / "README.md").read_text()


def test_float_export_loads_in_transformers_with_the_same_logits(
    ppo_run: Path, tmp_path: Path
) -> None:
    torch = pytest.importorskip("torch")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = export_model(ppo_run, tmp_path / "hf", fuse=True)
    model, tokenizer = mlx_load(out)
    hf_tokenizer = AutoTokenizer.from_pretrained(out)
    hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    ids = hf_tokenizer(PROMPT, add_special_tokens=False).input_ids
    assert ids == tokenizer.encode(PROMPT, add_special_tokens=False)
    with torch.no_grad():
        hf_logits = hf(input_ids=torch.tensor([ids])).logits[0].numpy()
    np.testing.assert_allclose(hf_logits, logits(model, tokenizer), atol=1e-4)
    assert hf.generation_config.eos_token_id == [0, 3]
    assert hf_tokenizer.chat_template is not None


def test_quantized_model_generates_and_exports_dequantized(
    quantized_dir: Path, tmp_path: Path
) -> None:
    q_model, q_tokenizer = mlx_load(quantized_dir)
    q_logits = logits(q_model, q_tokenizer)
    policy = ours(quantized_dir)
    assert generate_text(policy.model, policy.tokenizer, PROMPT, GREEDY, chat=False) == (
        mlx_lm_greedy(q_model, q_tokenizer)
    )

    kept = export_model(quantized_dir, tmp_path / "q4")  # still 4-bit
    assert json.loads((kept / "config.json").read_text())["quantization"]["bits"] == 4
    model, tokenizer = mlx_load(kept)
    np.testing.assert_allclose(logits(model, tokenizer), q_logits)
    assert "4-bit" in (kept / "README.md").read_text()

    out = export_model(quantized_dir, tmp_path / "float", dequantize=True)
    config = json.loads((out / "config.json").read_text())
    assert "quantization" not in config and "quantization_config" not in config
    model, tokenizer = mlx_load(out)
    names = [name for name, _ in cast(list[tuple[str, Any]], tree_flatten(model.parameters()))]
    assert not any("scales" in name for name in names)
    # Dequantization is exact: the same function up to the matmul's rounding.
    np.testing.assert_allclose(logits(model, tokenizer), q_logits, atol=1e-4)
    assert "dequantized" in (out / "README.md").read_text()

    torch = pytest.importorskip("torch")
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    ids = tokenizer.encode(PROMPT, add_special_tokens=False)
    with torch.no_grad():
        hf_logits = hf(input_ids=torch.tensor([ids])).logits[0].numpy()
    np.testing.assert_allclose(hf_logits, logits(model, tokenizer), atol=1e-4)


def test_lora_over_a_quantized_base_fuses_and_dequantizes(
    quantized_dir: Path, tmp_path: Path
) -> None:
    policy = PolicyModel.from_pretrained(quantized_dir, lora=LoraSettings(r=4, alpha=8, dropout=0))
    for _, layer in lora_modules(policy.model):  # trained-looking adapters
        layer.lora_b = 0.05 * mx.random.normal(layer.lora_b.shape, key=mx.random.key(1))
    adapters = policy.save_pretrained(tmp_path / "qlora")
    ref_model, tokenizer = mlx_load(quantized_dir, adapters)
    ref = logits(ref_model, tokenizer)

    out = export_model(adapters, tmp_path / "qlora_float", fuse=True, dequantize=True)
    model, tokenizer = mlx_load(out)
    assert "quantization" not in json.loads((out / "config.json").read_text())
    np.testing.assert_allclose(logits(model, tokenizer), ref, atol=1e-4)

    requantized = export_model(adapters, tmp_path / "qlora_q4", fuse=True)
    model, tokenizer = mlx_load(requantized)
    assert json.loads((requantized / "config.json").read_text())["quantization"]["bits"] == 4
    assert "re-quantized" in (requantized / "README.md").read_text()
    # What mlx_lm.fuse does without --dequantize: merge, then quantize again (so not exactly ref).
    from mlx.utils import tree_unflatten

    fused = [(n, m.fuse(dequantize=False)) for n, m in lora_modules(ref_model)]
    ref_model.update_modules(tree_unflatten(fused))
    np.testing.assert_allclose(logits(model, tokenizer), logits(ref_model, tokenizer), atol=1e-5)


@pytest.mark.slow
def test_commands_work_on_the_demo_output(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from examples.sentiment_demo import run_demo

    demo = tmp_path / "demo"
    run_demo(demo, smoke=True)  # runs/demo's layout at toy scale: sft/, reward/, ppo/
    capsys.readouterr()
    prompt = "Review of the sushi bar:"
    flags = ["--prompt", prompt, "--no-chat", "--temperature", "0", "--max-tokens", "8"]
    assert main.main(["generate", "--model", str(demo / "ppo"), *flags]) == 0
    text = capsys.readouterr().out
    # The README's mlx-lm command on the run's adapters gives the same greedy text.
    model, tokenizer = mlx_load(demo / "sft" / "model", demo / "ppo" / "final")
    assert text == mlx_lm_greedy(model, tokenizer, prompt, max_tokens=8) + "\n"
    out = demo / "ppo" / "exported"  # inside the run: fine
    assert main.main(["export", str(demo / "ppo"), "--out", str(out), "--fuse"]) == 0
    model, tokenizer = mlx_load(out)
    assert text == mlx_lm_greedy(model, tokenizer, prompt, max_tokens=8) + "\n"
    assert main.main(["generate", "--model", str(demo / "sft"), *flags]) == 0
    capsys.readouterr()
    assert main.main(["generate", "--model", str(demo / "reward"), *flags]) == 2
    assert "is a reward or value model" in capsys.readouterr().err
    (reward_checkpoint,) = (demo / "reward" / "checkpoints").iterdir()
    with pytest.raises(ValueError, match="checkpoint of a reward-model run"):
        resolve_trained_model(reward_checkpoint)


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("families")
    return {name: build_family_checkpoint(root / name, name) for name in sorted(FAMILIES)}


@pytest.mark.slow
def test_exports_of_every_checkpoint_family(family_dirs: dict[str, Path], tmp_path: Path) -> None:
    """The checkpoints people download, as shipped (fixtures/checkpoint_families.py): each
    export loads in mlx-lm as it is, with our loader's logits and every stop id (Qwen2.5 base:
    the template's <|im_end|>, which the checkpoint does not list), and in transformers where
    the card says so, with the same logits."""
    torch: Any = None
    if importlib.util.find_spec("torch") is not None:
        torch = importlib.import_module("torch")
    for name, source in family_dirs.items():
        policy = ours(source)
        out = export_model(source, tmp_path / name)
        model, tokenizer = mlx_load(out)
        assert tokenizer.eos_token_ids == policy.tokenizer.eos_token_ids, name
        generation = json.loads((out / "generation_config.json").read_text())
        stop_ids = sorted(policy.tokenizer.eos_token_ids)
        assert generation["eos_token_id"] == (stop_ids if len(stop_ids) > 1 else stop_ids[0])
        expected = logits(policy.model, policy.tokenizer)
        np.testing.assert_allclose(logits(model, tokenizer), expected, atol=1e-5, err_msg=name)
        card = (out / "README.md").read_text()
        readable = json.loads((out / "config.json").read_text())["model_type"] in (
            TRANSFORMERS_LAYOUT
        )
        assert ("AutoModelForCausalLM.from_pretrained" in card) == readable, name
        if torch is not None and readable:
            from transformers import AutoModelForCausalLM

            hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
            ids = policy.tokenizer.encode(PROMPT, add_special_tokens=False)
            with torch.no_grad():
                hf_logits = hf(input_ids=torch.tensor([ids])).logits[0].numpy()
            np.testing.assert_allclose(hf_logits, expected, atol=1e-4, err_msg=name)
    # Qwen2.5 base lists only <|endoftext|>; the export adds the template's end-of-turn token.
    source = json.loads((family_dirs["qwen2_base"] / "generation_config.json").read_text())
    exported = json.loads((tmp_path / "qwen2_base" / "generation_config.json").read_text())
    im_end = ours(family_dirs["qwen2_base"]).tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert source["eos_token_id"] != im_end and im_end in exported["eos_token_id"]
    assert "GPT-2's are not" in (tmp_path / "gpt2" / "README.md").read_text()


def test_a_4bit_family_checkpoint_exports_to_float_weights_transformers_reads(
    family_dirs: dict[str, Path], tmp_path: Path
) -> None:
    quantized = quantize_checkpoint(family_dirs["smollm2"], tmp_path / "q4")
    policy = ours(quantized)
    out = export_model(quantized, tmp_path / "float", dequantize=True)
    model, tokenizer = mlx_load(out)
    expected = logits(policy.model, policy.tokenizer)
    np.testing.assert_allclose(logits(model, tokenizer), expected, atol=1e-4)
    torch = pytest.importorskip("torch")
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    ids = policy.tokenizer.encode(PROMPT, add_special_tokens=False)
    with torch.no_grad():
        hf_logits = hf(input_ids=torch.tensor([ids])).logits[0].numpy()
    np.testing.assert_allclose(hf_logits, expected, atol=1e-4)


# --------------------------------------------------------------------------- errors


def test_wrong_paths_get_clear_errors(tmp_path: Path, tiny_model_dir: Path, ppo_run: Path) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist; expected a run directory"):
        resolve_trained_model(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match=r"\(it is empty\); expected"):
        resolve_trained_model(tmp_path / "empty")
    junk = tmp_path / "junk"
    junk.mkdir()
    (junk / "notes.txt").write_text("x")
    with pytest.raises(ValueError, match=r"\(found notes.txt\); expected .*adapters.safetensors"):
        resolve_trained_model(junk)
    with pytest.raises(ValueError, match="is a file"):
        resolve_trained_model(junk / "notes.txt")

    half = tmp_path / "half_adapters"
    half.mkdir()
    (half / "adapter_config.json").write_text("{}")
    with pytest.raises(ValueError, match="has no adapters.safetensors"):
        resolve_trained_model(half)
    orphan = tmp_path / "orphan"
    shutil.copytree(ppo_run / "final", orphan)
    config = json.loads((orphan / "adapter_config.json").read_text())
    del config["model"]
    (orphan / "adapter_config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match='does not record its base model.*add "model"'):
        resolve_trained_model(orphan)

    no_weights = tmp_path / "no_weights"
    no_weights.mkdir()
    (no_weights / "config.json").write_text((tiny_model_dir / "config.json").read_text())
    with pytest.raises(ValueError, match="no \\*.safetensors weights"):
        resolve_trained_model(no_weights)

    from models.reward_model import RewardModel

    reward = RewardModel.from_causal_lm(tiny_model_dir).save_pretrained(tmp_path / "reward")
    with pytest.raises(ValueError, match="reward or value model .* does not generate"):
        resolve_trained_model(reward)
    with pytest.raises(ValueError, match="reward or value model"):
        resolve_trained_model(ppo_run / "final" / "value_model")

    started = tmp_path / "started"
    started.mkdir()
    (started / "metrics.jsonl").write_text("")
    with pytest.raises(FileNotFoundError, match="run directory without a trained model"):
        resolve_trained_model(started)

    # The command line prints the message, no traceback.
    code = main.main(["generate", "--model", str(tmp_path / "missing"), "--prompt", "x"])
    assert code == 2
    assert main.main(["generate", "--model", str(ppo_run), "--prompt", "x", "--top-p", "0"]) == 2


def test_export_refuses_to_overwrite_and_is_atomic(
    ppo_run: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(ValueError, match="is not empty; .* --overwrite"):
        export_model(ppo_run, out)
    with pytest.raises(ValueError, match="overlaps the model being exported"):
        export_model(ppo_run, ppo_run / "final" / "export", overwrite=True)
    with pytest.raises(ValueError, match="overlaps"):
        export_model(ppo_run / "final", ppo_run, overwrite=True)
    with pytest.raises(ValueError, match="overlaps"):
        export_model(ppo_run, ppo_run.parent, overwrite=True)
    with pytest.raises(ValueError, match="overlaps"):  # would replace the value model
        export_model(ppo_run, ppo_run / "final" / "value_model", overwrite=True)

    # A crash while writing leaves neither a partial export nor a damaged old one.
    def crash(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("disk full")

    monkeypatch.setattr(export_module, "_write_model_card", crash)
    with pytest.raises(OSError, match="could not write the export .*disk full"):
        export_model(ppo_run, out, overwrite=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    assert [p.name for p in out.iterdir()] == ["keep.txt"]
    monkeypatch.undo()

    export_model(ppo_run, out, overwrite=True)
    assert not (out / "keep.txt").exists() and (out / "config.json").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


# --------------------------------------------------------------------------- as a TRL user expects


def test_generate_chat_and_export_take_hub_repo_ids_as_train_does(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import huggingface_hub

    from ppo_trainer.trained_model import resolve_trained_model

    asked: list[str] = []

    def fake_download(repo: str, *args: Any, **kwargs: Any) -> str:  # no network in tests
        asked.append(repo)
        return str(tiny_model_dir)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_download)
    found = resolve_trained_model("someone/tiny-chat")
    assert asked == ["someone/tiny-chat"]
    assert found.kind == "model" and found.path == tiny_model_dir
    with pytest.raises(FileNotFoundError, match="does not exist"):
        resolve_trained_model("runs/nothing/here")  # a path, not an id: no download
    assert asked == ["someone/tiny-chat"]


def test_generate_is_greedy_unless_a_temperature_is_given() -> None:
    parser = main.build_parser()
    for command in ("generate", "chat"):
        extra = ["--prompt", "Hi"] if command == "generate" else []
        args = parser.parse_args([command, "--model", "m", *extra])
        assert args.temperature == 0.0  # as mlx_lm.generate
        args = parser.parse_args([command, "--model", "m", "--temperature", "0.7", *extra])
        assert args.temperature == 0.7


def test_train_prompts_from_a_hub_dataset(monkeypatch: pytest.MonkeyPatch) -> None:
    import datasets

    rows = [
        {"prompt": "Review of the lamp:", "answer": "4"},
        {"messages": [{"role": "user", "content": "Hi"}]},
    ]
    monkeypatch.setattr(datasets, "load_dataset", lambda name, split: rows[:1])
    assert main.read_prompts("someone/prompts") == [
        {"prompt": "Review of the lamp:", "answer": "4"}
    ]
    monkeypatch.setattr(datasets, "load_dataset", lambda name, split: rows[1:])
    assert main.read_prompts("someone/chats") == [[{"role": "user", "content": "Hi"}]]
    monkeypatch.setattr(datasets, "load_dataset", lambda name, split: [{"text": "x"}])
    with pytest.raises(ValueError, match="someone/bad\\[train\\] row 0: expected an object"):
        main.read_prompts("someone/bad")
    with pytest.raises(FileNotFoundError, match="prompt file missing.jsonl does not exist"):
        main.read_prompts("missing.jsonl")


def test_generate_sends_prompts_as_the_run_trained_on_them() -> None:
    # --chat / --no-chat win; else the run's use_chat_template; "auto" or no run: the tokenizer
    assert main._chat_flag(None, {"use_chat_template": False}) is False
    assert main._chat_flag(None, {"use_chat_template": True}) is True
    assert main._chat_flag(None, {"use_chat_template": "auto"}) is None
    assert main._chat_flag(None, None) is None
    assert main._chat_flag(True, {"use_chat_template": False}) is True
