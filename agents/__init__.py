"""Agents: multi-turn rollouts in which the policy calls tools and environments answer.

The pieces the trainer drives, in the order of an episode (docs/agents.md):

* :mod:`agents.tools`: Python functions with type hints and Google docstrings as tools, their
  JSON schemas from ``transformers.utils.get_json_schema`` (TRL's contract).
* :mod:`agents.environment`: TRL's ``environment_factory`` contract (``reset``, public methods as
  tools, an optional ``get_reward``).
* :mod:`agents.tool_calls`: tool calls parsed from an assistant turn (Hermes/Qwen,
  Llama 3 JSON, Mistral, or a function of yours); malformed calls become messages.
* :mod:`agents.execution`: one call run with a timeout, its output truncated; every failure is
  a message the model reads.
* :mod:`agents.code_tool`: a ``python_code`` tool that runs code in the sandbox (:mod:`sandbox`).
* :mod:`agents.rendering`: the tool turns as tokens, written by the model's chat template.
* :mod:`agents.chat_templates`: a template that renders tools for ChatML checkpoints whose own
  does not (``tool_chat_template: chatml_tools``).
* :mod:`agents.episode`: one rollout's state (:class:`Episode`).

Nothing here imports MLX: the trainer (``ppo_trainer``) owns generation and the losses.
"""

from agents.chat_templates import CHATML_TOOLS, TOOL_CHAT_TEMPLATES, tool_chat_template
from agents.environment import (
    build_environment,
    check_environment_factory,
    environment_tools,
    factory_name,
    takes_seed,
)
from agents.episode import INVALID_CALL_NAME, AgentSettings, Episode
from agents.execution import ToolError, ToolResult, execute_call, truncate
from agents.rendering import (
    check_template_supports_tools,
    continuation_tokens,
    prompt_tokens,
    render_text,
)
from agents.tool_calls import (
    PARSERS,
    ParsedTurn,
    ToolCall,
    ToolCallParser,
    parse_hermes,
    parse_llama3_json,
    parse_mistral,
    resolve_parser,
)
from agents.tools import Tool, make_tools, tool_schema

__all__ = [
    "CHATML_TOOLS",
    "INVALID_CALL_NAME",
    "PARSERS",
    "TOOL_CHAT_TEMPLATES",
    "AgentSettings",
    "Episode",
    "ParsedTurn",
    "Tool",
    "ToolCall",
    "ToolCallParser",
    "ToolError",
    "ToolResult",
    "build_environment",
    "check_environment_factory",
    "check_template_supports_tools",
    "continuation_tokens",
    "environment_tools",
    "execute_call",
    "factory_name",
    "make_tools",
    "parse_hermes",
    "parse_llama3_json",
    "parse_mistral",
    "prompt_tokens",
    "render_text",
    "resolve_parser",
    "takes_seed",
    "tool_chat_template",
    "tool_schema",
    "truncate",
]
