"""The agent keys of a run: how many rounds of tool calls an episode may have, and how each call
is read, limited in time and truncated (docs/agents.md). They apply to PPO, GRPO and RLOO runs
given ``tools=`` or ``environment_factory=``; a run without tools ignores them."""

import re
from dataclasses import dataclass
from pathlib import Path

from config._fields import check_field_types, is_positive, require

#: The tool-call formats the agents room reads (agents.tool_calls).
TOOL_CALL_PARSERS: tuple[str, ...] = ("hermes", "llama3_json", "mistral")
#: The built-in tool-rendering chat templates (agents.chat_templates.TOOL_CHAT_TEMPLATES).
TOOL_CHAT_TEMPLATES: tuple[str, ...] = ("chatml_tools",)
_FUNCTION_SPEC = re.compile(r"^(?:[A-Za-z_][\w.]*|[^:]+\.py):[A-Za-z_]\w*$")


@dataclass(kw_only=True)
class AgentConfig:
    """Tool calling in multi-turn rollouts.

    Attributes:
        max_tool_calling_iterations: Most rounds of tool calls in an episode (TRL's name; also
            readable and settable as max_turns): after each assistant turn that calls tools, the
            calls run and the model continues, at most this many times; a turn's calls after
            that are not run and the episode ends. 0 = tools are described but never run. TRL's
            default is no limit (bounded by the completion length); a number here, so that an
            episode always ends.
        tool_timeout_s: Wall-clock seconds one tool call may take; a call that takes longer
            ends the wait and the model reads a timeout message (a Python tool runs in a thread
            that cannot be stopped; code tools run in the sandbox, whose process is killed).
        max_tool_output_chars: Longest tool output the model reads, in characters; the rest is
            cut, with a note of how much was.
        tool_call_parser: How tool calls are read from the model's text: "hermes" (Qwen2.5,
            Qwen3, Hermes: <tool_call>{"name": ..., "arguments": {...}}</tool_call>),
            "llama3_json" (Llama 3.x: the turn is {"name": ..., "parameters": {...}}),
            "mistral" ([TOOL_CALLS][{...}]), or "module:function" / "path/file.py:function",
            a function text -> agents.ParsedTurn.
        tool_chat_template: A chat template that renders tools, used instead of the
            checkpoint's in a run with tools: "chatml_tools" (ChatML with Hermes tool calls,
            for ChatML checkpoints whose template renders no tools, such as
            SmolLM2-Instruct; pair with tool_call_parser "hermes") or the path of a Jinja
            file; None = the checkpoint's own. A fully saved model keeps it; LoRA adapters
            load their base's.
    """

    max_tool_calling_iterations: int = 5
    tool_timeout_s: float = 10.0
    max_tool_output_chars: int = 2000
    tool_call_parser: str = "hermes"
    tool_chat_template: str | None = None

    def __post_init__(self) -> None:
        check_field_types(self, AgentConfig)
        require(
            self.max_tool_calling_iterations >= 0,
            "max_tool_calling_iterations",
            self.max_tool_calling_iterations,
            ">= 0",
            "set the most rounds of tool calls per episode, e.g. 5",
        )
        require(
            is_positive(self.tool_timeout_s),
            "tool_timeout_s",
            self.tool_timeout_s,
            "> 0",
            "set the seconds a tool call may take, e.g. 10",
        )
        require(
            self.max_tool_output_chars >= 1,
            "max_tool_output_chars",
            self.max_tool_output_chars,
            ">= 1",
            "set the longest tool output the model reads, e.g. 2000",
        )
        require(
            self.tool_call_parser in TOOL_CALL_PARSERS
            or bool(_FUNCTION_SPEC.match(self.tool_call_parser)),
            "tool_call_parser",
            self.tool_call_parser,
            f"one of {list(TOOL_CALL_PARSERS)} or 'module:function'",
            "pick the format the model's chat template uses (Qwen: hermes)",
        )
        if self.tool_chat_template is not None:
            require(
                self.tool_chat_template in TOOL_CHAT_TEMPLATES
                or Path(self.tool_chat_template).expanduser().is_file(),
                "tool_chat_template",
                self.tool_chat_template,
                f"one of {list(TOOL_CHAT_TEMPLATES)} or a Jinja file",
                "use chatml_tools for a ChatML checkpoint (<|im_start|>/<|im_end|>), or the "
                "path of a template that renders tools",
            )

    @property
    def max_turns(self) -> int:
        """``max_tool_calling_iterations`` under its other common name."""
        return self.max_tool_calling_iterations
