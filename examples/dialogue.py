"""Multi-turn dialogue with PPO: the policy writes the next assistant turn of a conversation.

Prompts are conversations (``[{"role": ..., "content": ...}, ...]`` ending with a user turn)
rendered by the tokenizer's chat template, so the policy answers in its own chat format.

The reward is a preference-trained reward model (``reward_model_name``: a
``*ForSequenceClassification`` checkpoint, e.g. one written by ``python main.py reward``) that
scores the rendered conversation + reply. Without one, the trainer falls back to
:func:`keyword_heuristic_score`, a STAND-IN for tests and offline runs only: it counts politeness
and helpfulness phrases, words shared with the user's last message, and penalises rude phrases
and replies that are very short or very long. It does not measure whether a reply is helpful or
true, and a policy trained on it learns to say "thank you" a lot.

Data: JSONL records ``{"messages": [...]}`` (the bundled ``data/dialogue.jsonl``, 30 short
conversations written for this project, each ending with a reply), or a Hub dataset with a
``messages`` column (e.g. ``HuggingFaceH4/ultrachat_200k``, split ``train_sft``) or Anthropic HH's
``chosen`` text (``Anthropic/hh-rlhf``). A conversation is cut after its last user turn:
:func:`dialogue_record` turns a row into the prompt record ``{"prompt": messages, "reply": ...}``
(the reply that followed, if any: what the embedded tiny model's SFT learns).

Run: ``python -m examples.dialogue`` (offline: the embedded tiny model, first fine-tuned on the
training conversations' replies, :func:`dialogue_sft_record`; heuristic reward), or
``--model <chat model> --set reward_model_name=<reward model>``.
"""

from __future__ import annotations

if __name__ == "__main__":  # run as a script: MLX's fast BLAS before anything imports mlx
    from base_setup import setup_blas

    setup_blas()

import logging
import re
import sys
from typing import Any, Mapping, Sequence

from config.ppo_config import PPOConfig
from examples.task_common import DATA_DIR, run_task_cli, task_argument_parser
from finetune.records import require_object
from ppo_trainer.ppo_trainer import PPOTrainer
from ppo_trainer.prompt_records import Prompt

logger = logging.getLogger("ppo_mlx")

BUNDLED_DATA = DATA_DIR / "dialogue.jsonl"
ROLES = ("system", "user", "assistant")
Messages = list[dict[str, str]]

#: PPO settings of the command line (overridable with --set or --config).
TASK_DEFAULTS: dict[str, Any] = dict(
    max_new_tokens=48,
    batch_size=4,
    learning_rate=1e-4,
    num_ppo_epochs=2,
    num_mini_batches=2,
    kl_coef=0.05,
    temperature=0.7,
    total_steps=20,
)
#: SFT of the embedded tiny model (no --model) on the data's replies, before PPO: enough to
#: do the task a little on the training prompts, not so much that sampling stops exploring.
SFT_SETTINGS: dict[str, Any] = dict(
    learning_rate=3e-3, batch_size=8, total_steps=30, warmup_steps=2, progress_bar=True
)
#: PPO settings of the embedded tiny model's run (over TASK_DEFAULTS). lam=1: the value head starts
#: untrained, and GAE's lam < 1 would pass the first tokens little of the score's credit; the
#: evaluations sample at the training temperature, as PPO's rollouts do.
TINY_DEFAULTS: dict[str, Any] = dict(
    max_new_tokens=48,
    batch_size=8,
    learning_rate=1e-3,
    total_steps=25,
    lam=1.0,
    eval_temperature=0.7,
)

# --------------------------------------------------------------------------- the stand-in reward

POLITE_PHRASES = ("please", "thank", "glad", "happy to", "sorry", "you're welcome", "of course")
HELPFUL_PHRASES = (
    "you can",
    "try",
    "for example",
    "first",
    "then",
    "because",
    "i suggest",
    "i recommend",
    "step",
)
RUDE_PHRASES = ("stupid", "idiot", "shut up", "dumb", "whatever", "not my problem", "go away")
_STOPWORDS = frozenset(
    "about after also been before being could does doing from have having here into just like "
    "more most much need only other over same should some such than that their them then there "
    "these they this those very want were what when where which while will with would your "
    "yours".split()
)


def _has_phrase(text: str, phrase: str) -> bool:
    return re.search(r"\b" + re.escape(phrase), text) is not None


def _content_words(text: str) -> set[str]:
    return {w for w in re.findall(r"[a-z']+", text.lower()) if len(w) >= 4 and w not in _STOPWORDS}


def keyword_heuristic_score(
    messages: Sequence[Mapping[str, str]],
    reply: str,
    *,
    min_words: int = 5,
    max_words: int = 80,
) -> float:
    """A keyword heuristic for a reply to a conversation; a STAND-IN, not a learned reward.

    ``score = 0.25 * min(2, #polite) + 0.25 * min(2, #helpful) + relevance - 0.5 * #rude
    + length``, where ``#polite``/``#helpful``/``#rude`` count the distinct phrases of
    :data:`POLITE_PHRASES`/:data:`HELPFUL_PHRASES`/:data:`RUDE_PHRASES` in the reply
    (lower-cased, at a word start), ``relevance`` is the share of the last user message's content
    words (4+ letters, not stop words) that the reply repeats, and ``length`` is -0.5 below
    ``min_words`` words, ``-min(1, 0.01 * (words - max_words))`` above ``max_words``, else 0.
    An empty reply scores -1. Range about [-1.5 - 0.5 * #rude, 2].
    """
    words = reply.split()
    if not words:
        return -1.0
    text = reply.lower()
    polite = sum(_has_phrase(text, p) for p in POLITE_PHRASES)
    helpful = sum(_has_phrase(text, p) for p in HELPFUL_PHRASES)
    rude = sum(_has_phrase(text, p) for p in RUDE_PHRASES)
    user_turns = [m["content"] for m in messages if m["role"] == "user"]
    asked = _content_words(user_turns[-1]) if user_turns else set()
    relevance = len(asked & _content_words(reply)) / len(asked) if asked else 0.0
    if len(words) < min_words:
        length = -0.5
    elif len(words) > max_words:
        length = -min(1.0, 0.01 * (len(words) - max_words))
    else:
        length = 0.0
    return 0.25 * min(2, polite) + 0.25 * min(2, helpful) + relevance - 0.5 * rude + length


def heuristic_reward(
    prompts: list[str], completions: list[str], prompt: list[Prompt]
) -> list[float]:
    """:func:`keyword_heuristic_score` of each reply to its conversation (the ``prompt`` column:
    the messages as given; a text prompt is one user turn); the stand-in reward when the config
    names no reward model."""
    conversations = [_as_messages(p) for p in prompt]
    return [keyword_heuristic_score(m, c) for m, c in zip(conversations, completions)]


def _as_messages(prompt: Prompt) -> Messages:
    return [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt


# --------------------------------------------------------------------------- the data

_HH_TURN = re.compile(r"\n\n(Human|Assistant): ")


def parse_hh_dialogue(text: str) -> Messages:
    """Anthropic HH text (``"\\n\\nHuman: ...\\n\\nAssistant: ..."``) as chat messages."""
    parts = _HH_TURN.split(text)
    if len(parts) < 3 or parts[0].strip():
        raise ValueError("not an Anthropic HH dialogue (expected '\\n\\nHuman: ...' turns)")
    roles = {"Human": "user", "Assistant": "assistant"}
    return [
        {"role": roles[role], "content": content.strip()}
        for role, content in zip(parts[1::2], parts[2::2])
    ]


def conversation_prompt(messages: Sequence[Mapping[str, Any]], where: str) -> Messages:
    """The conversation up to and including its last user turn (the turn the policy answers).

    Raises:
        ValueError: malformed messages, or no user turn.
    """
    if not isinstance(messages, Sequence) or isinstance(messages, str) or not messages:
        raise ValueError(f"{where}: 'messages' must be a non-empty list of messages")
    out: Messages = []
    for i, m in enumerate(messages):
        if (
            not isinstance(m, Mapping)
            or m.get("role") not in ROLES
            or not isinstance(m.get("content"), str)
        ):
            raise ValueError(
                f"{where}: messages[{i}] must be {{'role': one of {ROLES}, 'content': text}}, "
                f"got {m!r:.80}"
            )
        out.append({"role": str(m["role"]), "content": str(m["content"])})
    last_user = max((i for i, m in enumerate(out) if m["role"] == "user"), default=None)
    if last_user is None or not out[last_user]["content"].strip():
        raise ValueError(f"{where}: the conversation has no (non-empty) user turn to answer")
    return out[: last_user + 1]


def _record_messages(record: Any, where: str) -> Sequence[Any]:
    record = require_object(record, where, "'messages', or Anthropic HH's 'chosen'")
    if "messages" in record:
        messages: Sequence[Any] = record["messages"]
        return messages
    if isinstance(record.get("chosen"), str):
        try:
            return parse_hh_dialogue(record["chosen"])
        except ValueError as err:
            raise ValueError(f"{where}: 'chosen' is {err}") from err
    raise ValueError(
        f"{where}: expected 'messages' (a list of {{'role', 'content'}}) or an Anthropic HH "
        f"'chosen' text; found fields {sorted(record)}"
    )


def dialogue_record(record: Any, where: str) -> dict[str, Any]:
    """The prompt record ``{"prompt": messages, "reply": text or None}`` of a row holding a
    conversation with a user turn (``messages``, or Anthropic HH ``chosen`` text): ``prompt`` is
    the conversation cut after its last user turn, ``reply`` the assistant turn that follows it
    in the row, if any (the demonstration the embedded tiny model's SFT learns; the reward does
    not read it).

    Raises:
        ValueError: ``"<where>: ..."`` for a malformed row.
    """
    messages = _record_messages(record, where)
    prompt = conversation_prompt(messages, where)
    rest = messages[len(prompt) :]
    reply = None
    if rest and rest[0]["role"] == "assistant" and rest[0]["content"].strip():
        reply = str(rest[0]["content"])
    return {"prompt": prompt, "reply": reply}


def dialogue_sft_record(
    record: Mapping[str, Any], system_prompt: str | None = None
) -> dict[str, Any] | None:
    """The SFT record of a prompt record with a ``reply`` (None without one): the conversation
    (after ``system_prompt`` if it has no system message, as :class:`DialogueTrainer` renders
    it) and the reply as the final assistant turn."""
    if record.get("reply") is None:
        return None
    messages = list(record["prompt"])
    if system_prompt is not None and messages[0]["role"] != "system":
        messages = [{"role": "system", "content": system_prompt}] + messages
    return {"messages": messages + [{"role": "assistant", "content": record["reply"]}]}


# --------------------------------------------------------------------------- the trainer


class DialogueTrainer(PPOTrainer):
    """PPO on conversations: the policy writes the next assistant turn.

    Trains on conversations (chat messages ending with a user turn, or the records of
    :func:`dialogue_record`). Overrides :meth:`format_prompt` (an optional system message, then
    the chat template). The reward is the configured reward model; without one,
    :func:`heuristic_reward` (a stand-in).

    Args:
        config: the run configuration; set ``reward_model_name`` for a real reward.
        system_prompt: a system message put before conversations that have none; None = none.
        **components: ``policy``, ``ref_model``, ``reward_model``, ``value_model``,
            ``tokenizer``, as for :class:`PPOTrainer`; a ``reward_model`` (a reward model or a
            function) replaces the stand-in.
    """

    def __init__(
        self, config: PPOConfig, *, system_prompt: str | None = None, **components: Any
    ) -> None:
        self.system_prompt = system_prompt
        if components.get("reward_model") is None and config.reward_model_name is None:
            logger.warning(
                "DialogueTrainer: no reward_model_name, so replies are scored by "
                "keyword_heuristic_score, a stand-in for tests and offline runs (not a "
                "measure of helpfulness)"
            )
            components["reward_model"] = heuristic_reward
        super().__init__(config, **components)

    def format_prompt(self, prompt: Prompt) -> str:
        """The conversation (with ``system_prompt`` first if it has no system message) in the
        tokenizer's chat template, ending with the header of the assistant's turn."""
        prompt = _as_messages(prompt)
        messages = conversation_prompt(prompt, "prompt")
        if len(messages) != len(prompt):
            raise ValueError(
                "a dialogue prompt must end with the user turn to answer; drop the trailing "
                "assistant turns"
            )
        if self.system_prompt is not None and messages[0]["role"] != "system":
            messages = [{"role": "system", "content": self.system_prompt}] + messages
        return super().format_prompt(messages)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m examples.dialogue [--model DIR] [--steps N] ...``"""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    parser = task_argument_parser(__doc__.split("\n\n")[0], BUNDLED_DATA)
    parser.add_argument("--system-prompt", help="system message for conversations without one")
    args = parser.parse_args(argv)
    return run_task_cli(
        args,
        to_record=dialogue_record,
        task_defaults=TASK_DEFAULTS,
        default_output_dir="runs/dialogue",
        to_sft=lambda record: dialogue_sft_record(record, args.system_prompt),
        sft_settings=SFT_SETTINGS,
        tiny_defaults=TINY_DEFAULTS,
        build=lambda config: DialogueTrainer(config, system_prompt=args.system_prompt),
    )


if __name__ == "__main__":
    sys.exit(main())
