"""agents/: tools from functions, tool-call parsing, execution with a timeout, environments, the
episode, and tool turns rendered by tool-capable chat templates (fixture tokenizers shaped like
Qwen2.5's and Qwen3's); plus the tool-use example's task. Pure Python, no model."""

from __future__ import annotations

import dataclasses
import fractions
import json
import logging
import math
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from agents import (
    tool_chat_template,
    build_environment,
    factory_name,
    takes_seed,
    INVALID_CALL_NAME,
    AgentSettings,
    Episode,
    ParsedTurn,
    ToolCall,
    Tool,
    ToolError,
    ToolResult,
    check_environment_factory,
    check_template_supports_tools,
    continuation_tokens,
    environment_tools,
    execute_call,
    make_tools,
    parse_hermes,
    parse_llama3_json,
    parse_mistral,
    prompt_tokens,
    render_text,
    resolve_parser,
)
from fixtures.checkpoint_families import CHATML_TEMPLATE, build_family_tokenizer


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first.
        b: The second.
    """
    return a + b


def shout(text: str, times: int = 1) -> str:
    """Repeat a text in capitals.

    Args:
        text: What to repeat.
        times: How many times.
    """
    return text.upper() * times


def fail(reason: str) -> str:
    """Always fail.

    Args:
        reason: The message.
    """
    raise RuntimeError(reason)


def refuse(reason: str) -> str:
    """Fail in the tool's own words.

    Args:
        reason: The message.
    """
    raise ToolError(reason)


TOOLS = make_tools([add, shout, fail, refuse])
BY_NAME = {t.name: t for t in TOOLS}


def plain(messages: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Tool messages without their call ids (tested on their own)."""
    if messages is None:
        return None
    return [{k: v for k, v in m.items() if k != "tool_call_id"} for m in messages]


def run(name: str, arguments: dict[str, Any], **kwargs: Any) -> Any:
    options = {"timeout_s": 5.0, "max_output_chars": 100, **kwargs}
    return execute_call(ToolCall(name, arguments), BY_NAME, **options)


# --------------------------------------------------------------------------- tools


def test_a_tool_is_described_by_its_type_hints_and_docstring() -> None:
    schema = BY_NAME["shout"].schema
    assert schema["type"] == "function"
    assert schema["function"]["name"] == "shout"
    assert schema["function"]["description"] == "Repeat a text in capitals."
    params = schema["function"]["parameters"]
    assert params["properties"]["text"] == {"type": "string", "description": "What to repeat."}
    assert params["properties"]["times"]["type"] == "integer"
    assert params["required"] == ["text"]


def test_a_tool_without_docstring_or_type_hints_is_refused_by_name() -> None:
    def no_doc(a: int) -> int:
        return a

    def no_hints(a):
        """Do.

        Args:
            a: a thing.
        """
        return a

    def undocumented_argument(a: int, b: int) -> int:
        """Do.

        Args:
            a: a thing.
        """
        return a

    cases: list[tuple[Callable[..., Any], str]] = [
        (no_doc, "docstring"),
        (no_hints, "type hint"),
        (undocumented_argument, "b"),
    ]
    for function, missing in cases:
        with pytest.raises(ValueError, match=function.__name__) as err:
            make_tools([function])
        assert missing in str(err.value)
    with pytest.raises(ValueError, match="must be a function"):
        not_a_function: list[Any] = [add, "add"]
        make_tools(not_a_function)
    with pytest.raises(ValueError, match="list of functions"):
        make_tools(add)  # type: ignore[arg-type]


def test_two_tools_of_one_name_are_refused() -> None:
    def add(x: int) -> int:  # noqa: F811 (the point: a second "add")
        """Another add.

        Args:
            x: x.
        """
        return x

    with pytest.raises(ValueError, match="two tools are named 'add'"):
        make_tools([TOOLS[0], add])


# --------------------------------------------------------------------------- parsing


def test_hermes_reads_every_call_in_order_and_names_the_malformed_ones() -> None:
    text = (
        "Let me compute.\n<tool_call>\n"
        '{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>\n'
        "<tool_call>{not json}</tool_call>"
        '<tool_call>{"arguments": {"a": 1}}</tool_call>'
        '<tool_call>{"name": "add", "arguments": [1, 2]}</tool_call>'
        '<tool_call>{"name": "shout", "arguments": "{\\"text\\": \\"hi\\"}"}</tool_call>'
        '<tool_call>{"name": "shout", "arguments": {"text": "cut off"}}'
    )
    parsed = parse_hermes(text)
    assert parsed.calls == [
        ToolCall("add", {"a": 1, "b": 2}),
        ToolCall("shout", {"text": "hi"}),  # arguments given as a JSON string
        ToolCall("shout", {"text": "cut off"}),  # unterminated at the token limit
    ]
    assert len(parsed.errors) == 3
    assert "not valid JSON" in parsed.errors[0] and "<tool_call>" in parsed.errors[0]
    assert 'no "name"' in parsed.errors[1]
    assert "must be a JSON object" in parsed.errors[2]
    assert parse_hermes("The answer is 3.") == ParsedTurn()
    assert not parse_hermes("The answer is 3.").has_calls


def test_llama3_json_reads_the_turn_as_calls_and_plain_text_as_an_answer() -> None:
    one = '{"name": "add", "parameters": {"a": 1, "b": 2}}'
    assert parse_llama3_json(one).calls == [ToolCall("add", {"a": 1, "b": 2})]
    two = '<|python_tag|>{"name": "add", "parameters": {"a": 1, "b": 2}}; {"name": "shout", "parameters": {"text": "x"}}<|eom_id|>'
    assert [c.name for c in parse_llama3_json(two).calls] == ["add", "shout"]
    assert parse_llama3_json("It is 3.") == ParsedTurn()
    broken = parse_llama3_json('{"name": "add", "parameters": {"a": 1,')
    assert broken.calls == [] and "not valid JSON" in broken.errors[0]


def test_mistral_reads_both_tool_call_forms() -> None:
    v3 = 'Sure. [TOOL_CALLS][{"name": "add", "arguments": {"a": 1, "b": 2}}, {"name": "shout", "arguments": {"text": "x"}}]</s>'
    assert parse_mistral(v3).calls == [
        ToolCall("add", {"a": 1, "b": 2}),
        ToolCall("shout", {"text": "x"}),
    ]
    v11 = '[TOOL_CALLS]add[ARGS]{"a": 1, "b": 2}[TOOL_CALLS]shout[ARGS]{"text": "x"}</s>'
    assert parse_mistral(v11).calls == [
        ToolCall("add", {"a": 1, "b": 2}),
        ToolCall("shout", {"text": "x"}),
    ]
    assert parse_mistral("No calls.") == ParsedTurn()
    assert parse_mistral("[TOOL_CALLS][{broken").errors


@pytest.mark.parametrize("depth", [900, 1_000, 100_000])
@pytest.mark.parametrize("opening", ["[", '{"a": '])
@pytest.mark.parametrize(
    "parser, prefix, suffix",
    [
        ("hermes", '<tool_call>{"name": "add", "arguments": ', "}</tool_call>"),
        ("llama3_json", '{"name": "add", "parameters": ', "}"),
        ("mistral", "[TOOL_CALLS]add[ARGS]", ""),
        ("mistral", '[TOOL_CALLS][{"name": "add", "arguments": ', "}]"),
    ],
)
def test_a_call_nested_too_deep_is_an_error_for_the_model_not_a_crash(
    parser: str, prefix: str, suffix: str, opening: str, depth: int
) -> None:
    """issue #47: ~1000 nested ``[`` or ``{"a": `` raised RecursionError out of the parser
    (and train()); any depth is now one message, closed or cut off at the token limit."""
    closing = "]" if opening == "[" else "}"
    for body in (opening * depth + "1" + closing * depth, opening * depth):
        parsed = resolve_parser(parser)(prefix + body + suffix)
        assert parsed.calls == [] and len(parsed.errors) == 1, parsed.errors
        assert "nested more than 100 levels deep" in parsed.errors[0], parsed.errors


_DEEP_STRING_CALL = json.dumps({"name": "add", "arguments": "[" * 1_000 + "]" * 1_000})


@pytest.mark.parametrize(
    "parser, text",
    [
        ("hermes", f"<tool_call>{_DEEP_STRING_CALL}</tool_call>"),
        ("llama3_json", _DEEP_STRING_CALL),
        ("mistral", f"[TOOL_CALLS][{_DEEP_STRING_CALL}]"),
    ],
)
def test_arguments_written_as_a_deep_json_string_are_an_error_too(parser: str, text: str) -> None:
    parsed = resolve_parser(parser)(text)
    assert parsed.calls == [] and len(parsed.errors) == 1, parsed.errors
    assert "nested more than 100 levels deep" in parsed.errors[0]


def test_resolve_parser_takes_a_name_or_a_function() -> None:
    assert resolve_parser("hermes") is parse_hermes
    custom = lambda text: ParsedTurn()  # noqa: E731
    assert resolve_parser(custom) is custom
    with pytest.raises(ValueError, match="tool_call_parser must be one of"):
        resolve_parser("json")


# --------------------------------------------------------------------------- execution


def test_a_call_returns_the_tools_output_as_text() -> None:
    assert run("add", {"a": 2, "b": 3}) == run("add", {"b": 3, "a": 2})
    result = run("add", {"a": 2, "b": 3})
    assert (result.name, result.content, result.ok) == ("add", "5", True)
    assert run("shout", {"text": "ab", "times": 2}).content == "ABAB"


def test_every_failure_is_a_message_for_the_model() -> None:
    unknown = run("divide", {"a": 1})
    assert unknown == ToolResult(
        "divide", "Error: unknown tool 'divide'; the tools are: add, fail, refuse, shout", False
    )
    alone = execute_call(ToolCall("add", {}), {}, timeout_s=1, max_output_chars=100)
    assert alone.content == "Error: unknown tool 'add'; the tools are: none"
    two = run("add", {"a": 1, "c": 3}, max_output_chars=200)
    assert two.content == (
        "Error: bad arguments for add: unknown argument 'c'; missing required argument 'b'. "
        "Usage: add(a: integer, b: integer)"
    )
    missing = run("add", {"a": 1})
    assert not missing.ok and "missing required argument 'b'" in missing.content
    assert "add(a: integer, b: integer)" in missing.content  # how to call it
    extra = run("add", {"a": 1, "b": 2, "c": 3})
    assert not extra.ok and "unknown argument 'c'" in extra.content
    wrong_type = run("add", {"a": "1", "b": 2})
    assert not wrong_type.ok and "'a' must be of type integer" in wrong_type.content
    assert not run("add", {"a": True, "b": 2}).ok  # JSON true is not an integer
    raised = run("fail", {"reason": "disk on fire"})
    assert (raised.ok, raised.content) == (False, "Error: fail raised RuntimeError: disk on fire")
    own_words = run("refuse", {"reason": "Error: no such key"})
    assert (own_words.ok, own_words.content) == (False, "Error: no such key")


@dataclasses.dataclass
class _Point:
    x: int
    y: int


class _Opaque:
    """No text form of its own: its repr holds its memory address."""


def test_a_result_json_cannot_encode_is_converted_the_same_way_every_run_with_one_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """issue #47: a tool result JSON cannot encode was sent as its repr, memory address
    included, so the same seed gave different runs; nothing warned."""
    returns: dict[str, Any] = {
        "a_set": {3, 1, 2},
        "a_point": _Point(1, 2),
        "an_array": np.array([1.5, 2.0]),
        "a_fraction": fractions.Fraction(1, 3),
        "opaque": _Opaque(),
    }

    def give(kind: str) -> Any:
        """Return a value JSON cannot encode.

        Args:
            kind: Which.
        """
        return returns[kind]

    tools = {"give": make_tools([give])[0]}
    with caplog.at_level(logging.WARNING, logger="ppo_mlx"):
        results = {
            kind: [
                execute_call(
                    ToolCall("give", {"kind": kind}), tools, timeout_s=5, max_output_chars=200
                )
                for _ in range(2)
            ]
            for kind in returns
        }
    assert {k: (r[0].ok, r[0].content) for k, r in results.items()} == {
        "a_set": (True, "[1, 2, 3]"),
        "a_point": (True, '{"x": 1, "y": 2}'),
        "an_array": (True, "[1.5, 2.0]"),
        "a_fraction": (True, "1/3"),
        "opaque": (
            False,
            "Error: give returned a _Opaque, which is not JSON and has no text form of its own",
        ),
    }
    assert all(r[0] == r[1] for r in results.values())
    warnings = [r.getMessage() for r in caplog.records if "'give' returned" in r.getMessage()]
    assert len(warnings) == len(returns)  # one per tool and type, not one per call
    assert "0x" not in "".join(r[0].content for r in results.values())


def test_arguments_are_checked_by_the_schema_as_written() -> None:
    """A hand-written schema: an untyped argument, a type list, a type the check does not know;
    a value JSON cannot write is sent as text."""
    schema = {
        "type": "function",
        "function": {
            "name": "raw",
            "description": "Return a set.",
            "parameters": {
                "type": "object",
                "properties": {
                    "x": {},
                    "y": {"type": ["integer", "null"]},
                    "z": {"type": "custom"},
                    "w": {"type": "number"},
                    "v": {"type": ["integer", "boolean"]},
                },
                "required": ["x"],
            },
        },
    }
    tools = {"raw": Tool("raw", lambda **kwargs: {3}, schema)}

    def call(**arguments: Any) -> Any:
        return execute_call(ToolCall("raw", arguments), tools, timeout_s=5, max_output_chars=200)

    # A set is sent sorted, as JSON (its str order changes with PYTHONHASHSEED for strings).
    assert call(x="anything", y=None, z=[1]) == ToolResult("raw", "[3]", True)
    assert call(x=1, y=2, w=2).ok and call(x=1, w=2.5).ok
    assert not call(x=1, w=True).ok  # JSON true is not a number
    assert call(x=1, v=True).ok  # ... but it is a boolean
    assert call(x=1, y="2") == ToolResult(
        "raw",
        "Error: bad arguments for raw: argument 'y' must be of type ['integer', 'null'], got "
        "\"2\". Usage: raw(x: any, y: ['integer', 'null'], z: custom, w: number, v: ['integer', 'boolean'])",
        False,
    )


def test_output_is_truncated_with_a_note() -> None:
    result = run("shout", {"text": "a", "times": 250}, max_output_chars=100)
    assert result.ok
    assert result.content == "A" * 100 + "\n[... 150 more characters truncated]"
    assert run("shout", {"text": "a", "times": 100}, max_output_chars=100).content == "A" * 100


def test_a_hanging_tool_times_out_without_hanging_the_caller() -> None:
    release = threading.Event()

    def hang(seconds: int) -> str:
        """Wait.

        Args:
            seconds: How long.
        """
        release.wait(120)
        return "late"

    (tool,) = make_tools([hang])
    start = time.monotonic()
    result = execute_call(
        ToolCall("hang", {"seconds": 100}), {"hang": tool}, timeout_s=0.2, max_output_chars=100
    )
    elapsed = time.monotonic() - start
    episode = Episode([tool], AgentSettings(tool_timeout_s=0.2))
    in_episode = episode.step(
        '<tool_call>{"name": "hang", "arguments": {"seconds": 1}}</tool_call>'
    )
    release.set()  # let the abandoned threads end
    assert (result.ok, result.content) == (False, "Error: hang timed out after 0.2 s")
    assert in_episode is not None and in_episode[0]["content"] == result.content
    assert elapsed < 60  # far less than the tool would take: the caller did not wait for it


# --------------------------------------------------------------------------- environments


class Store:
    """A key-value memory: the episode's environment (TRL's environment_factory contract)."""

    def __init__(self) -> None:
        self._data: dict[str, str] = {}
        self.resets: list[dict[str, Any]] = []

    def reset(self, **record: Any) -> str | None:
        self.resets.append(record)
        self._data = dict(record.get("facts", {}))
        return "You have a memory store." if record.get("intro") else None

    def write(self, key: str, value: str) -> str:
        """Remember a value.

        Args:
            key: The key.
            value: The value.
        """
        self._data[key] = value
        return "ok"

    def read(self, key: str) -> str:
        """Recall a value.

        Args:
            key: The key.
        """
        if key not in self._data:
            raise ToolError(f"Error: nothing stored under {key!r}")
        return self._data[key]

    def get_reward(self) -> float:
        return float(len(self._data))

    def _helper(self) -> None:
        pass

    @property
    def size(self) -> int:
        raise AssertionError("looking for tools must not run a property")

    @staticmethod
    def describe(topic: str) -> str:
        """Describe the store.

        Args:
            topic: What to describe.
        """
        return f"a store of {topic}"


def test_an_environments_public_methods_are_its_tools() -> None:
    tools = environment_tools(Store())
    # not reset, get_reward, _helper, the property
    assert [t.name for t in tools] == ["describe", "read", "write"]
    assert tools[0].function("keys") == "a store of keys"
    assert list(tools[2].schema["function"]["parameters"]["properties"]) == ["key", "value"]
    check_environment_factory(Store)


def test_a_bad_environment_is_named_before_any_rollout() -> None:
    class NoReset:
        def read(self, key: str) -> str:
            """Read.

            Args:
                key: k.
            """
            return key

    class NoTools:
        def reset(self, **record: Any) -> None:
            return None

    class Undocumented(NoTools):
        def read(self, key):
            return key

    with pytest.raises(ValueError, match="NoReset has no reset method"):
        check_environment_factory(NoReset)
    with pytest.raises(ValueError, match="NoTools has no tools"):
        check_environment_factory(NoTools)
    with pytest.raises(ValueError, match="read"):
        check_environment_factory(Undocumented)
    with pytest.raises(ValueError, match="environment_factory must be a callable"):
        check_environment_factory(Store())  # type: ignore[arg-type]


def test_an_episode_with_an_environment_keeps_its_state_and_reward() -> None:
    env = Store()
    episode = Episode(make_tools([add]), AgentSettings(), environment=env)
    assert sorted(episode.tools) == ["add", "describe", "read", "write"]
    assert episode.start({"prompt": "p", "intro": True, "facts": {"a": "1"}}) == (
        "You have a memory store."
    )
    assert env.resets == [{"prompt": "p", "intro": True, "facts": {"a": "1"}}]
    call = '<tool_call>{"name": "write", "arguments": {"key": "b", "value": "2"}}</tool_call>'
    assert plain(episode.step(call)) == [{"role": "tool", "name": "write", "content": "ok"}]
    read = '<tool_call>{"name": "read", "arguments": {"key": "b"}}</tool_call><tool_call>{"name": "read", "arguments": {"key": "z"}}</tool_call>'
    assert plain(episode.step(read)) == [
        {"role": "tool", "name": "read", "content": "2"},
        {"role": "tool", "name": "read", "content": "Error: nothing stored under 'z'"},
    ]
    assert episode.step("Done.") is None
    assert (episode.turns, episode.calls, episode.successful_calls) == (3, 3, 2)
    assert episode.episode_reward() == 2.0


def test_an_environment_reward_per_turn_must_have_one_value_per_turn() -> None:
    class PerTurn(Store):
        def __init__(self, rewards: Any) -> None:
            super().__init__()
            self.rewards = rewards

        def get_reward(self) -> Any:
            return self.rewards

    def finished(rewards: Any) -> Episode:
        episode = Episode([], AgentSettings(), environment=PerTurn(rewards))
        episode.start({})
        episode.step(
            '<tool_call>{"name": "write", "arguments": {"key": "k", "value": "v"}}</tool_call>'
        )
        episode.step("Done.")
        return episode

    assert finished([0.5, 1.0]).episode_reward() == [0.5, 1.0]
    assert finished(np.float32(0.25)).episode_reward() == 0.25  # a NumPy scalar is a number
    with pytest.raises(
        ValueError,
        match="^environment PerTurn: get_reward.. returned 3 rewards for an episode of 2 assistant turns",
    ):
        finished([0.0, 0.0, 1.0]).episode_reward()
    with pytest.raises(ValueError, match="finite numbers"):
        finished(math.nan).episode_reward()
    assert Episode([], AgentSettings()).episode_reward() is None  # no environment

    class NoReward:
        def reset(self, **record: Any) -> None:
            return None

        def noop(self) -> str:
            """Do nothing."""
            return ""

    assert Episode([], AgentSettings(), environment=NoReward()).episode_reward() is None


def test_environment_and_tool_of_one_name_and_a_bad_reset_are_refused() -> None:
    def read(key: str) -> str:
        """Read.

        Args:
            key: k.
        """
        return key

    with pytest.raises(ValueError, match="tool 'read' is given twice"):
        Episode(make_tools([read]), AgentSettings(), environment=Store())

    class BadReset(Store):
        def reset(self, **record: Any) -> Any:
            return 3

    with pytest.raises(ValueError) as err:
        Episode([], AgentSettings(), environment=BadReset()).start({})
    assert str(err.value) == (
        "environment BadReset.reset() must return a str (text added to the prompt) or None, "
        "got int"
    )


# --------------------------------------------------------------------------- episode


def test_an_episode_runs_calls_until_a_turn_without_one() -> None:
    episode = Episode(TOOLS, AgentSettings(max_tool_calling_iterations=5))
    assert episode.start({"prompt": "p"}) is None  # no environment
    messages = plain(
        episode.step(
            '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call><tool_call>oops</tool_call>'
        )
    )
    assert messages is not None
    assert messages[0] == {"role": "tool", "name": "add", "content": "3"}
    assert messages[1]["name"] == INVALID_CALL_NAME and "not valid JSON" in messages[1]["content"]
    assert episode.step("The sum is 3.") is None
    assert episode.done and (episode.turns, episode.calls, episode.successful_calls) == (2, 2, 1)
    with pytest.raises(ValueError, match="after the episode ended"):
        episode.step("more")


def test_calls_after_max_tool_calling_iterations_are_not_run() -> None:
    calls = '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>'
    episode = Episode(TOOLS, AgentSettings(max_tool_calling_iterations=2))
    assert episode.step(calls) is not None
    assert episode.step(calls) is not None
    assert episode.step(calls) is None  # a third round: the episode ends, the call is not run
    assert (episode.turns, episode.rounds, episode.calls) == (3, 2, 2)
    assert Episode(TOOLS, AgentSettings(max_tool_calling_iterations=0)).step(calls) is None


def test_a_turn_cut_by_the_token_budget_counts_but_runs_nothing() -> None:
    class PerTurn(Store):
        def get_reward(self) -> Any:
            return [0.5, 0.0]

    episode = Episode([], AgentSettings(), environment=PerTurn())
    episode.start({})
    assert episode.step('<tool_call>{"name": "read", "arguments": {"key": "k"}}</tool_call>')
    episode.cut()  # the second turn ran out of tokens
    assert (episode.done, episode.turns, episode.calls) == (True, 2, 1)
    assert episode.episode_reward() == [0.5, 0.0]
    with pytest.raises(ValueError, match="^Episode.cut called after the episode ended$"):
        episode.cut()


def test_a_custom_parser_is_used_and_checked() -> None:
    def every_word_adds(text: str) -> ParsedTurn:
        return ParsedTurn(calls=[ToolCall("add", {"a": 1, "b": 1}) for _ in text.split()])

    episode = Episode(TOOLS, AgentSettings(tool_call_parser=every_word_adds))
    assert plain(episode.step("two words")) == [{"role": "tool", "name": "add", "content": "2"}] * 2
    broken = Episode(TOOLS, AgentSettings(tool_call_parser=lambda text: []))  # type: ignore
    with pytest.raises(ValueError, match="must return agents.ParsedTurn"):
        broken.step("x")


def test_settings_come_from_the_config_and_max_turns_is_an_alias() -> None:
    from config import load_config

    config = load_config(None, ["model_name=m", "max_turns=3", "tool_timeout_s=2.5"])
    assert (config.max_tool_calling_iterations, config.max_turns) == (3, 3)
    settings = AgentSettings.from_config(config)
    assert (settings.max_tool_calling_iterations, settings.tool_timeout_s) == (3, 2.5)
    assert settings.tool_call_parser == "hermes"
    with pytest.raises(ValueError, match="tool_call_parser"):
        load_config(None, ["model_name=m", "tool_call_parser=xml"])
    with pytest.raises(ValueError, match="tool_timeout_s"):
        load_config(None, ["model_name=m", "tool_timeout_s=0"])
    spec = load_config(None, ["model_name=m", "tool_call_parser=my_parsers:read_calls"])
    with pytest.raises(ValueError, match="pass load_function"):
        AgentSettings.from_config(spec)
    loaded = AgentSettings.from_config(
        spec, load_function={"my_parsers:read_calls": parse_mistral}.__getitem__
    )
    assert loaded.tool_call_parser is parse_mistral
    short = load_config(None, ["model_name=m", "max_tool_output_chars=50"])
    assert AgentSettings.from_config(short).max_tool_output_chars == 50


# --------------------------------------------------------------------------- rendering


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Qwen2.5- and Qwen3-style tool templates, ChatML without tools, and no template."""
    from transformers import AutoTokenizer

    root = tmp_path_factory.mktemp("tool_tokenizers")
    out = {
        name: AutoTokenizer.from_pretrained(build_family_tokenizer(root / name, name))
        for name in ("qwen25_tools", "qwen3_tools")
    }
    for name, template in [("chatml", CHATML_TEMPLATE), ("none", None)]:
        tok = AutoTokenizer.from_pretrained(root / "qwen25_tools")
        tok.chat_template = template
        out[name] = tok
    return out


CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
HISTORY = [{"role": "user", "content": "What is 1 + 2?"}, {"role": "assistant", "content": CALL}]
RESULTS = [
    {"role": "tool", "name": "add", "content": "3"},
    {"role": "tool", "name": "add", "content": "4"},
]


def test_model_tokens_plus_continuation_are_the_templates_conversation(
    tokenizers: dict[str, Any],
) -> None:
    """prompt + the model's turn (its text and <|im_end|>) + continuation_tokens = the whole
    conversation as the template writes it: what the KV cache holds is what a fresh prefill of
    the conversation would be."""
    tok = tokenizers["qwen25_tools"]
    tools = make_tools([add])
    prompt = prompt_tokens(tok, HISTORY[:1], tools=tools)
    model_turn = tok.encode(CALL, add_special_tokens=False) + [
        tok.convert_tokens_to_ids("<|im_end|>")
    ]
    continuation = continuation_tokens(tok, HISTORY, RESULTS, tools=tools, template_kwargs={})
    whole = render_text(tok, HISTORY + RESULTS, tools=tools, add_generation_prompt=True)
    assert prompt + model_turn + continuation == tok.encode(whole, add_special_tokens=False)
    # Both results in one user turn, then the assistant's generation prompt.
    assert tok.decode(continuation) == (
        "\n<|im_start|>user\n<tool_response>\n3\n</tool_response>\n<tool_response>\n4\n"
        "</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )
    assert '"name": "add"' in tok.decode(prompt)  # the model is shown its tool


def test_a_turn_cut_at_the_token_limit_gets_the_end_of_turn_token_first(
    tokenizers: dict[str, Any],
) -> None:
    tok = tokenizers["qwen25_tools"]
    tools = make_tools([add])
    ended = continuation_tokens(tok, HISTORY, RESULTS[:1], tools=tools, template_kwargs={})
    cut = continuation_tokens(
        tok, HISTORY, RESULTS[:1], tools=tools, template_kwargs={}, ended_turn=False
    )
    assert cut == [tok.convert_tokens_to_ids("<|im_end|>")] + ended


def test_qwen3_rewrites_the_past_turn_and_the_continuation_still_follows_the_model(
    tokenizers: dict[str, Any],
) -> None:
    """Qwen3's template writes the model's turn with an empty think block while it is the last
    message and without it once tool messages follow: the text before the model's last token
    differs, what follows it does not. template_kwargs reach the generation prompt."""
    tok = tokenizers["qwen3_tools"]
    tools = make_tools([add])
    check_template_supports_tools(tok, tools)
    alone = render_text(tok, HISTORY, tools=tools, add_generation_prompt=False)
    followed = render_text(tok, HISTORY + RESULTS[:1], tools=tools, add_generation_prompt=True)
    assert "<think>\n\n</think>\n\n" + CALL in alone and not followed.startswith(alone)
    off = continuation_tokens(
        tok, HISTORY, RESULTS[:1], tools=tools, template_kwargs={"enable_thinking": False}
    )
    on = continuation_tokens(tok, HISTORY, RESULTS[:1], tools=tools, template_kwargs={})
    results = "\n<|im_start|>user\n<tool_response>\n3\n</tool_response><|im_end|>\n"
    assert tok.decode(off) == results + "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    assert tok.decode(on) == results + "<|im_start|>assistant\n"
    # The tool tags are plain added tokens: decoding without special tokens keeps a call.
    ids = tok.encode(CALL + "<|im_end|>", add_special_tokens=False)
    assert parse_hermes(tok.decode(ids, skip_special_tokens=True)).calls == [
        ToolCall("add", {"a": 1, "b": 2})
    ]


def test_a_template_without_tool_support_is_refused_with_what_to_do(
    tokenizers: dict[str, Any],
) -> None:
    tools = make_tools([add])
    check_template_supports_tools(tokenizers["qwen25_tools"], tools)
    with pytest.raises(ValueError, match="ignores tools="):
        check_template_supports_tools(tokenizers["chatml"], tools)
    with pytest.raises(ValueError, match="has none"):
        check_template_supports_tools(tokenizers["none"], tools)
    tok = tokenizers["chatml"]
    tok.chat_template = (
        "{% if tools %}{{ tools | tojson }}{% endif %}{% for m in messages %}"
        "{% if m.role != 'tool' %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
        "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    try:
        with pytest.raises(ValueError, match="drops messages of role 'tool'"):
            check_template_supports_tools(tok, tools)
        # A template that writes an assistant turn only while it is the last message loses
        # the model's turn once tool messages follow: nothing can be continued.
        tok.chat_template = CHATML_TEMPLATE.replace(
            "{% for message in messages %}",
            "{% for message in messages %}{% if message.role != 'assistant' or loop.last %}",
        ).replace("{% endfor %}", "{% endif %}{% endfor %}")
        with pytest.raises(ValueError, match="renders the model's turn differently"):
            continuation_tokens(tok, HISTORY, RESULTS, tools=tools, template_kwargs={})
    finally:
        tok.chat_template = CHATML_TEMPLATE


def test_the_builtin_chatml_tools_template_renders_tools_for_a_chatml_tokenizer(
    tokenizers: dict[str, Any],
) -> None:
    """``tool_chat_template: chatml_tools`` on a ChatML tokenizer whose template renders no
    tools: it passes the run's check, writes the tool turns in Qwen2.5's (Hermes) format, and
    without tools renders what plain ChatML renders."""
    tok = tokenizers["chatml"]
    tools = make_tools([add])
    plain = render_text(tok, HISTORY, tools=[], add_generation_prompt=True)
    tok.chat_template = tool_chat_template("chatml_tools")
    try:
        check_template_supports_tools(tok, tools)
        assert render_text(tok, HISTORY, tools=[], add_generation_prompt=True) == plain
        prompt = render_text(tok, HISTORY[:1], tools=tools, add_generation_prompt=True)
        assert prompt.startswith("<|im_start|>system\n# Tools")
        assert '<tools>\n{"type": "function", "function": {"name": "add"' in prompt
        assert prompt.endswith(
            "<|im_start|>user\nWhat is 1 + 2?<|im_end|>\n<|im_start|>assistant\n"
        )
        ids = continuation_tokens(tok, HISTORY, RESULTS, tools=tools, template_kwargs={})
        assert tok.decode(ids) == (
            "\n<|im_start|>user\n<tool_response>\n3\n</tool_response>\n<tool_response>\n4"
            "\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
        )
        system = [{"role": "system", "content": "Be brief."}, *HISTORY[:1]]
        text = render_text(tok, system, tools=tools, add_generation_prompt=True)
        assert (
            text.startswith("<|im_start|>system\nBe brief.\n\n# Tools")
            and text.count("system") == 1
        )
    finally:
        tok.chat_template = CHATML_TEMPLATE
    with pytest.raises(ValueError, match="neither a built-in template"):
        tool_chat_template("chatml_tool")


# Mistral's v3 tool format, in the parts that matter here: user/assistant turns must alternate
# (an assistant turn with tool_calls does not count), the tools go before the last user turn, a
# tool message needs its call's 9-character id.
MISTRAL_TOOLS_TEMPLATE = (
    "{%- set users = messages | selectattr('role', 'equalto', 'user') | list %}"
    "{%- set ns = namespace(index=0) %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'user' or (m.role == 'assistant' and m.tool_calls is not defined) %}"
    "{%- if (m.role == 'user') != (ns.index % 2 == 0) %}"
    "{{- raise_exception('conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{%- endif %}{%- set ns.index = ns.index + 1 %}{%- endif %}{%- endfor %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'user' %}"
    "{%- if tools and m == users[-1] %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]"
    "{%- endif %}[INST]{{ m.content }}[/INST]"
    "{%- elif m.role == 'assistant' and m.tool_calls is defined %}[TOOL_CALLS]["
    "{%- for c in m.tool_calls %}{{ {'name': c.function.name, 'arguments': c.function.arguments, "
    "'id': c.id} | tojson }}{%- if not loop.last %}, {% endif %}{%- endfor %}]{{ eos_token }}"
    "{%- elif m.role == 'assistant' %}{{ m.content }}{{ eos_token }}"
    "{%- elif m.role == 'tool' %}"
    "{%- if m.tool_call_id is not defined or m.tool_call_id | length != 9 %}"
    "{{- raise_exception('Tool call IDs should be alphanumeric strings with length 9!') }}"
    "{%- endif %}[TOOL_RESULTS]{{ {'content': m.content, 'call_id': m.tool_call_id} | tojson }}"
    "[/TOOL_RESULTS]{%- endif %}{%- endfor %}"
)


def test_a_template_that_needs_structured_calls_gets_them(
    tokenizers: dict[str, Any],
) -> None:
    """Mistral's templates refuse tool messages that answer no call: the episode's assistant
    message carries its calls as tool_calls, with the ids its tool messages answer."""
    tok = tokenizers["chatml"]
    tok.chat_template = MISTRAL_TOOLS_TEMPLATE
    try:
        tools = make_tools([add, shout])
        check_template_supports_tools(tok, tools)
        episode = Episode(tools, AgentSettings(tool_call_parser="mistral"))
        text = (
            '[TOOL_CALLS][{"name": "add", "arguments": {"a": 1, "b": 2}}, '
            '{"name": "shout", "arguments": {"text": "x"}}]'
        )
        results = episode.step(text)
        assert results is not None
        assert [m["tool_call_id"] for m in results] == ["call00000", "call00001"]
        turn = episode.assistant_message(text)
        assert turn["tool_calls"][1] == {
            "id": "call00001",
            "type": "function",
            "function": {"name": "shout", "arguments": {"text": "x"}},
        }
        history = [{"role": "user", "content": "Go"}, turn]
        continuation = continuation_tokens(tok, history, results, tools=tools, template_kwargs={})
        assert tok.decode(continuation) == (
            '[TOOL_RESULTS]{"content": "3", "call_id": "call00000"}[/TOOL_RESULTS]'
            '[TOOL_RESULTS]{"content": "X", "call_id": "call00001"}[/TOOL_RESULTS]'
        )
        # A second round: the structured turns render; the same turns as plain text break the
        # template's rule (two assistant turns in a row), with a clear message.
        again = episode.step(text)
        assert again is not None and again[0]["tool_call_id"] == "call00002"
        second = [*history, *results, episode.assistant_message(text)]
        assert continuation_tokens(tok, second, again, tools=tools, template_kwargs={})
        as_text = {"role": "assistant", "content": text}
        plain_history = [history[0], as_text, *results, as_text]
        with pytest.raises(ValueError, match="must alternate"):
            continuation_tokens(tok, plain_history, again, tools=tools, template_kwargs={})
        assert episode.step("Done.") is None
        assert episode.assistant_message("Done.") == {"role": "assistant", "content": "Done."}
    finally:
        tok.chat_template = CHATML_TEMPLATE


# --------------------------------------------------------------------------- code tool


def test_python_code_runs_in_the_sandbox_and_is_stopped_at_its_deadline() -> None:
    from agents.code_tool import make_python_code_tool, python_code
    from sandbox import SandboxLimits

    assert make_tools([python_code])[0].schema["function"]["parameters"]["required"] == ["code"]
    # A generous deadline for the programs that finish (the machine may be loaded).
    roomy = make_python_code_tool(SandboxLimits(timeout_s=60.0, cpu_time_s=30))
    quick = make_python_code_tool(SandboxLimits(timeout_s=0.5, cpu_time_s=1), name="quick")
    tools = {"python_code": roomy, "quick": quick}

    def run_code(name: str, code: str) -> Any:
        call = ToolCall(name, {"code": code})
        return execute_call(call, tools, timeout_s=120, max_output_chars=200)

    ok = run_code("python_code", "print(2 ** 100)")
    assert (ok.ok, ok.content) == (True, "1267650600228229401496703205376\n")
    raised = run_code("python_code", "print('before')\n1 / 0")
    assert not raised.ok  # the sandbox may add a note on what it ignored
    assert raised.content.startswith(
        "before\n\nError: the program raised ZeroDivisionError: division by zero"
    )
    # The sandbox's own deadline stops the loop (the thread's timeout is far longer).
    looped = run_code("quick", "while True: pass")
    assert (looped.ok, looped.content) == (
        False,
        "Error: the program did not finish within 0.5 s and was stopped",
    )


# --------------------------------------------------------------------------- the example's task


def test_the_calculator_does_arithmetic_and_nothing_else() -> None:
    from examples.tool_use_task import calculator

    assert calculator("4821 * 397") == f"4821 * 397 = {4821 * 397}"
    assert calculator(" (12 + -3) * 4  // 5 % 7 ") == f"(12 + -3) * 4 // 5 % 7 = {9 * 4 // 5 % 7}"
    for bad in [
        "__import__('os')",
        "2 ** 10",
        "1.5 * 2",
        "x",
        "1 // 0",
        "9" * 40 + " * " + "9" * 40,
        "1 +",
    ]:
        with pytest.raises(ValueError):
            calculator(bad)


def test_the_task_is_seeded_and_its_reward_reads_the_final_turn() -> None:
    from examples.tool_use_task import HELD_OUT, NUM_PROBLEMS, answer_reward, problems

    train, held_out = problems(3)
    assert problems(3) == (train, held_out) and problems(4)[0] != train
    assert len(held_out) == HELD_OUT and len(train) + HELD_OUT == NUM_PROBLEMS
    questions = [r["prompt"][0]["content"] for r in train + held_out]
    assert len(set(questions)) == len(questions)
    transcript = (
        CALL + "<|im_end|>\n<|im_start|>user\n<tool_response>\n3\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\nThe answer is 3.<|im_end|>"
    )
    on_a_call = transcript.split("<|im_start|>assistant")[0]  # ended on the tool's result
    messages = [{"role": "assistant", "content": CALL}, {"role": "tool", "content": "3"}]
    answered = messages + [{"role": "assistant", "content": "It is 1,003."}]
    assert answer_reward(
        [transcript, on_a_call, "3", messages, answered], answer=["3", "3", "3", "3", "1003"]
    ) == [1.0, 0.0, 1.0, 0.0, 1.0]


def test_a_demonstration_is_a_call_the_episode_runs_to_the_answer() -> None:
    from examples.tool_use_task import answer_reward, calculator, demonstration, problems

    record = problems(0)[0][5]
    demo = demonstration(record)
    user, call, result, final = demo["messages"]
    assert user == record["prompt"][0]
    episode = Episode(make_tools([calculator]), AgentSettings())
    assert plain(episode.step(call["content"])) == [result]
    assert result["content"] == f"{record['prompt'][0]['content'][8:-1]} = {record['answer']}"
    assert episode.step(final["content"]) is None
    assert answer_reward([demo["messages"]], answer=[record["answer"]]) == [1.0]
    assert demo["tools"] == episode.schemas
    json.dumps(demo)  # an SFT record: plain JSON


def test_a_share_of_the_demonstrations_answer_without_the_calculator() -> None:
    from examples.tool_use_task import answer_reward, demonstrations, problems

    train = problems(0)[0]
    demos = demonstrations(train, 8, call_share=0.75)
    calls = [len(d["messages"]) == 4 for d in demos]
    assert calls == [False, True, True, True, False, True, True, True]
    direct = demos[0]["messages"]
    assert [m["role"] for m in direct] == ["user", "assistant"]
    assert "<tool_call>" not in direct[1]["content"]
    assert answer_reward([direct], answer=[train[0]["answer"]]) == [1.0]
    assert all(len(d["messages"]) == 4 for d in demonstrations(train, 5))  # all call by default


def test_the_examples_shaped_reward_counts_a_calculator_result_and_the_answers_digits() -> None:
    from examples.tool_use import shaped_reward

    def episode(result: str, answer: str) -> str:
        return (
            "<tool_call>...</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\n"
            f"{result}\n</tool_response><|im_end|>\n<|im_start|>assistant\n{answer}<|im_end|>"
        )

    right = episode("37 * 8 = 296", "37 * 8 = 296.")
    one_digit_off = episode("37 * 8 = 296", "37 * 8 = 206.")
    error = episode("Error: not an arithmetic expression: '37 *'", "37 * 8 = 296.")
    direct = "37 * 8 = 296."
    assert shaped_reward([right, one_digit_off, error, direct], answer=["296"] * 4) == [
        pytest.approx(2.0),
        pytest.approx(0.5 + 0.5 * 2 / 3),
        pytest.approx(1.5),
        pytest.approx(1.5),
    ]


def test_demonstrations_train_both_assistant_turns_with_the_tools_in_the_prompt(
    tokenizers: dict[str, Any], tmp_path: Path
) -> None:
    from examples.tool_use_task import demonstration, problems
    from finetune.tokenize import tokenize_sft

    tok = tokenizers["qwen25_tools"]
    demo = demonstration(problems(0)[0][0])
    (example,) = tokenize_sft([demo], tok, max_length=4096)
    spans, current = [], []
    for token, trained in zip(example.input_ids, example.loss_mask):
        if trained:
            current.append(token)
        elif current:
            spans.append(tok.decode(current))
            current = []
    spans += [tok.decode(current)] if current else []
    assert spans == [
        demo["messages"][1]["content"] + "<|im_end|>\n",
        demo["messages"][3]["content"] + "<|im_end|>\n",
    ]
    assert '"name": "calculator"' in tok.decode(example.input_ids)  # the tools' block


# --------------------------------------------------------------------------- parsing, case by case

HERMES_HINT = (
    '; write <tool_call>{"name": <tool name>, "arguments": {<argument>: <value>}}</tool_call>'
)
LLAMA_HINT = '; write {"name": <tool name>, "parameters": {<argument>: <value>}}'
MISTRAL_HINT = '; write [TOOL_CALLS][{"name": <tool name>, "arguments": {<argument>: <value>}}]'


@pytest.mark.parametrize(
    ("parser", "text", "calls", "errors"),
    [
        # hermes
        ("hermes", '<tool_call>{"name": "add", "parameters": {"a": 1}}</tool_call>',
         [ToolCall("add", {"a": 1})], []),
        ("hermes", '<tool_call>{"name": "add"}</tool_call><tool_call>{"name": "add", '
         '"arguments": null}</tool_call><tool_call>{"name": "add", "arguments": " "}</tool_call>',
         [ToolCall("add", {})] * 3, []),
        ("hermes", "<tool_call>{not json}</tool_call>", [],
         ["Error: the tool call {not json} is not valid JSON (Expecting property name enclosed "
          "in double quotes)" + HERMES_HINT]),
        ("hermes", "<tool_call>[1, 2]</tool_call>", [],
         ["Error: a tool call must be a JSON object with a name, got [1, 2]"]),
        ("hermes", '<tool_call>{"name": ""}</tool_call><tool_call>{"name": 3}</tool_call>', [],
         ['Error: the tool call {"name": ""} has no "name" (a string)',
          'Error: the tool call {"name": 3} has no "name" (a string)']),
        ("hermes", '<tool_call>{"name": "add", "arguments": [1, 2]}</tool_call>', [],
         ["Error: the arguments of the call to 'add' must be a JSON object of argument names "
          "to values, got [1, 2]"]),
        ("hermes", '<tool_call>{"name": "add", "arguments": "{oops"}</tool_call>', [],
         ["Error: the arguments of the call to 'add' are not valid JSON (Expecting property "
          "name enclosed in double quotes)"]),
        ("hermes", f'<tool_call>"{"y" * 198}"</tool_call>', [],
         [f'Error: a tool call must be a JSON object with a name, got "{"y" * 198}"']),
        ("hermes", f'<tool_call>"{"y" * 199}"</tool_call>', [],
         [f'Error: a tool call must be a JSON object with a name, got "{"y" * 199}...']),
        # llama3_json
        ("llama3_json", '<|python_tag|> {"name": "add", "arguments": {"a": 1}}',
         [ToolCall("add", {"a": 1})], []),
        ("llama3_json", '{"name": "add", "parameters": {}};  \n {"name": "shout", '
         '"parameters": {"text": "a"}}', [ToolCall("add", {}), ToolCall("shout", {"text": "a"})],
         []),
        ("llama3_json", '{"name": "add", "parameters": {}}X{"name": "shout", "parameters": {}}',
         [ToolCall("add", {})], []),  # text after the calls is not read as calls
        ("llama3_json", '{"nam": "add"}', [],
         ['Error: the tool call {"nam": "add"} has no "name" (a string)']),
        ("llama3_json", '{"name": "add", "parameters": {"a": 1,', [],
         ['Error: a tool call is not valid JSON (Expecting property name enclosed in double '
          'quotes in {"name": "add", "parameters": {"a": 1,)' + LLAMA_HINT]),
        # mistral
        ("mistral", '[TOOL_CALLS]{"name": "add", "parameters": {"a": 1}}',
         [ToolCall("add", {"a": 1})], []),
        ("mistral", '[TOOL_CALLS][{"name": "shout", "arguments": {"text": "[ARGS]"}}]',
         [ToolCall("shout", {"text": "[ARGS]"})], []),
        ("mistral", '[TOOL_CALLS]shout[ARGS]{"text": "[ARGS]"}',
         [ToolCall("shout", {"text": "[ARGS]"})], []),
        ("mistral", '[TOOL_CALLS]add[ARGS]not json[TOOL_CALLS]shout[ARGS]{"text": "x"}',
         [ToolCall("shout", {"text": "x"})],
         ["Error: the arguments of the call to 'add' are not a JSON object (not json)"]),
        ("mistral", "[TOOL_CALLS]add[ARGS]X{}", [],
         ["Error: the arguments of the call to 'add' are not a JSON object (X{})"]),
        ("mistral", "[TOOL_CALLS]add[ARGS][1]", [],
         ["Error: the arguments of the call to 'add' must be a JSON object of argument names "
          "to values, got [1]"]),
        ("mistral", '[TOOL_CALLS][{broken[TOOL_CALLS][{"name": "add", "arguments": {}}]',
         [ToolCall("add", {})],
         ["Error: the tool calls [{broken are not a JSON list (Expecting property name enclosed "
          "in double quotes in [{broken)" + MISTRAL_HINT]),
        ("mistral", '[TOOL_CALLS]X[{"name": "add", "arguments": {}}]', [],
         ['Error: the tool calls X[{"name": "add", "arguments": {}}] are not a JSON list (no '
          "JSON)" + MISTRAL_HINT]),
        ("mistral", "[TOOL_CALLS][1]", [],
         ["Error: a tool call must be a JSON object with a name, got 1"]),
    ],
)  # fmt: skip
def test_each_parser_reads_calls_and_words_its_errors(
    parser: str, text: str, calls: list[ToolCall], errors: list[str]
) -> None:
    assert resolve_parser(parser)(text) == ParsedTurn(calls=calls, errors=errors)


def test_the_parser_names_resolve_to_their_parsers() -> None:
    assert [resolve_parser(name) for name in ("hermes", "llama3_json", "mistral")] == [
        parse_hermes,
        parse_llama3_json,
        parse_mistral,
    ]


class _Seeded:
    def __init__(self, seed: int = 7) -> None:
        self.seed = seed


def test_a_factory_with_a_seed_parameter_is_built_from_the_seed() -> None:
    def keyword_only(*, seed: int) -> dict[str, int]:
        return {"seed": seed}

    def any_keywords(**kwargs: Any) -> dict[str, Any]:
        return kwargs

    assert takes_seed(_Seeded) and takes_seed(keyword_only)
    assert not takes_seed(any_keywords) and not takes_seed(dict)
    assert build_environment(_Seeded, 5).seed == 5
    assert build_environment(keyword_only, 3) == {"seed": 3}
    assert build_environment(any_keywords, 3) == {}  # TRL's zero-argument call
    assert factory_name(_Seeded) == "tests.test_agents:_Seeded"
