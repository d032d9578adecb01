"""One rollout's agent state: which tools it has, how it reads calls, what happened so far.

The trainer drives it turn by turn::

    episode = Episode(tools, settings, environment=factory() if factory else None)
    extra = episode.start(record)            # env.reset(**record): text for the prompt, or None
    while True:
        text = <generate the assistant turn>
        tool_messages = episode.step(text)  # None: the episode is over
        if tool_messages is None:
            break
        <append the assistant turn and tool_messages, render them, continue generating>
    reward = episode.episode_reward()        # env.get_reward(), or None
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from agents.environment import check_reward, environment_tools
from agents.execution import ToolResult, execute_call, truncate
from agents.tool_calls import PARSERS, ParsedTurn, ToolCall, ToolCallParser, resolve_parser
from agents.tools import Tool

#: The name of the tool message that answers a call the parser could not read.
INVALID_CALL_NAME = "invalid_tool_call"


def call_id(index: int) -> str:
    """The id of an episode's ``index``-th call: 9 alphanumeric characters, the form Mistral's
    templates require (``call00003``)."""
    return f"call{index:05d}"


@dataclass
class AgentSettings:
    """The agent part of a run's config (see :class:`config.agent_config.AgentConfig`).

    Attributes:
        max_tool_calling_iterations: Most rounds of tool calls per episode; a turn's calls
            after that are not run and the episode ends.
        tool_timeout_s: Wall-clock limit of one tool call.
        max_tool_output_chars: Longest tool output the model reads.
        tool_call_parser: A parser name (:data:`agents.tool_calls.PARSERS`) or a function.
        tool_chat_template: A template that renders tools, used instead of the checkpoint's
            (a name of :data:`agents.chat_templates.TOOL_CHAT_TEMPLATES` or a Jinja file);
            None = the checkpoint's.
    """

    max_tool_calling_iterations: int = 5
    tool_timeout_s: float = 10.0
    max_tool_output_chars: int = 2000
    tool_call_parser: str | ToolCallParser = "hermes"
    tool_chat_template: str | None = None

    def __post_init__(self) -> None:
        if self.max_tool_calling_iterations < 0:
            raise ValueError(
                "max_tool_calling_iterations must be >= 0, got "
                f"{self.max_tool_calling_iterations}"
            )
        if not self.tool_timeout_s > 0:
            raise ValueError(f"tool_timeout_s must be > 0, got {self.tool_timeout_s}")
        if self.max_tool_output_chars < 1:
            raise ValueError(
                f"max_tool_output_chars must be >= 1, got {self.max_tool_output_chars}"
            )
        resolve_parser(self.tool_call_parser)

    @classmethod
    def from_config(
        cls, config: Any, load_function: Callable[[str], Callable[..., Any]] | None = None
    ) -> AgentSettings:
        """The settings of a run config with the agent fields (``PPOConfig``); a
        ``tool_call_parser`` of the form ``"module:function"`` is loaded by ``load_function``
        (the trainer's loader of user functions).

        Raises:
            ValueError: a function spec and no ``load_function``.
        """
        parser: str | ToolCallParser = config.tool_call_parser
        if isinstance(parser, str) and parser not in PARSERS:
            if load_function is None:
                raise ValueError(
                    f"tool_call_parser {parser!r} names a function: pass load_function to load it"
                )
            parser = load_function(parser)
        return cls(
            max_tool_calling_iterations=config.max_tool_calling_iterations,
            tool_timeout_s=config.tool_timeout_s,
            max_tool_output_chars=config.max_tool_output_chars,
            tool_call_parser=parser,
            tool_chat_template=config.tool_chat_template,
        )


class Episode:
    """One rollout's agent state: its tools (the given ones plus its environment's), the
    parser, the transcript of calls and results, and the environment's reward.

    Attributes:
        turns: assistant turns seen by :meth:`step`.
        calls: tool calls attempted (malformed ones included).
        successful_calls: calls that returned without an error.
        results: every call's :class:`ToolResult`, in order (malformed calls included, under
            :data:`INVALID_CALL_NAME`).
        done: the episode is over (:meth:`step` returned None).
    """

    def __init__(
        self,
        tools: Sequence[Tool],
        settings: AgentSettings,
        environment: Any | None = None,
    ) -> None:
        own = list(tools) + (environment_tools(environment) if environment is not None else [])
        self.tools: dict[str, Tool] = {}
        for tool in own:
            if tool.name in self.tools:
                raise ValueError(
                    f"tool {tool.name!r} is given twice (as a tool and by the environment "
                    f"{type(environment).__name__}); rename one"
                )
            self.tools[tool.name] = tool
        self.settings = settings
        self.environment = environment
        self.parser = resolve_parser(settings.tool_call_parser)
        self.turns = 0
        self.calls = 0
        self.successful_calls = 0
        self.rounds = 0
        self.results: list[ToolResult] = []
        self.done = False
        self._last_calls: list[tuple[str, ToolCall]] = []

    @property
    def schemas(self) -> list[dict[str, Any]]:
        """The tools' JSON schemas, for ``apply_chat_template(..., tools=...)``."""
        return [tool.schema for tool in self.tools.values()]

    def start(self, record: Mapping[str, Any]) -> str | None:
        """Reset the environment with the prompt's record (``env.reset(**record)``); returns
        the text to append to the prompt's last user message, or None (also without an
        environment).

        Raises:
            ValueError: ``reset`` returned something other than a str or None.
        """
        if self.environment is None:
            return None
        text = self.environment.reset(**dict(record))
        if text is not None and not isinstance(text, str):
            raise ValueError(
                f"environment {type(self.environment).__name__}.reset() must return a str (text "
                f"added to the prompt) or None, got {type(text).__name__}"
            )
        return text

    def parse(self, assistant_text: str) -> ParsedTurn:
        """The tool calls of one assistant turn (the configured parser)."""
        parsed = self.parser(assistant_text)
        if not isinstance(parsed, ParsedTurn):
            raise ValueError(
                f"tool_call_parser must return agents.ParsedTurn, got {type(parsed).__name__}"
            )
        return parsed

    def step(self, assistant_text: str) -> list[dict[str, Any]] | None:
        """Read one assistant turn and run its calls.

        Returns:
            None when the turn holds no tool call, or ``max_tool_calling_iterations`` rounds
            have run (the episode is over); else the tool messages
            ``{"role": "tool", "name": ..., "content": ..., "tool_call_id": ...}`` to append,
            one per call in order, then one per malformed call. Append the turn itself as
            :meth:`assistant_message` before them.
        """
        if self.done:
            raise ValueError("Episode.step called after the episode ended (it returned None)")
        self.turns += 1
        parsed = self.parse(assistant_text)
        self._last_calls = []
        if not parsed.has_calls or self.rounds >= self.settings.max_tool_calling_iterations:
            self.done = True
            return None
        self.rounds += 1
        limit = self.settings.max_tool_output_chars
        results = [
            execute_call(
                call, self.tools, timeout_s=self.settings.tool_timeout_s, max_output_chars=limit
            )
            for call in parsed.calls
        ]
        results += [ToolResult(INVALID_CALL_NAME, truncate(e, limit), False) for e in parsed.errors]
        ids = [call_id(self.calls + i) for i in range(len(results))]
        self._last_calls = list(zip(ids, parsed.calls))
        self.results += results
        self.calls += len(results)
        self.successful_calls += sum(r.ok for r in results)
        return [
            {"role": "tool", "name": r.name, "content": r.content, "tool_call_id": i}
            for i, r in zip(ids, results)
        ]

    def cut(self) -> None:
        """End the episode on a turn the token budget cut before its end: it counts as an
        assistant turn (a per-turn reward list has an entry for it), but its text is not read
        and its calls do not run.

        Raises:
            ValueError: the episode had already ended.
        """
        if self.done:
            raise ValueError("Episode.cut called after the episode ended")
        self.turns += 1
        self._last_calls = []
        self.done = True

    def assistant_message(self, assistant_text: str) -> dict[str, Any]:
        """The assistant turn last given to :meth:`step`, as a chat message: its text, and its
        calls as ``tool_calls`` (OpenAI's form, with the ids the tool messages answer), which
        templates such as Mistral's require before tool messages. Only the rendering *after*
        the turn is used (:func:`agents.rendering.continuation_tokens`), so a template that
        writes the calls a second time from ``tool_calls`` changes nothing the model reads."""
        message: dict[str, Any] = {"role": "assistant", "content": assistant_text}
        if self._last_calls:
            message["tool_calls"] = [
                {
                    "id": identifier,
                    "type": "function",
                    "function": {"name": call.name, "arguments": call.arguments},
                }
                for identifier, call in self._last_calls
            ]
        return message

    def episode_reward(self) -> float | list[float] | None:
        """``env.get_reward()`` checked (a finite float, or one per assistant turn), or None
        when there is no environment or it has no ``get_reward``."""
        if self.environment is None:
            return None
        get_reward = getattr(self.environment, "get_reward", None)
        if get_reward is None:
            return None
        return check_reward(get_reward(), self.turns, type(self.environment).__name__)
