"""Chat templates that render tools, for checkpoints whose own template does not.

Many instruct checkpoints speak ChatML (``<|im_start|>role\\n...<|im_end|>``) but ship a
template that ignores ``tools=`` and drops ``tool`` messages: SmolLM2-Instruct's, for one. A run
with tools then stops at :func:`agents.check_template_supports_tools`. ``tool_chat_template:
chatml_tools`` puts :data:`CHATML_TOOLS` in its place: the same ChatML turns, plus the Hermes
tool format that ``tool_call_parser: hermes`` reads (Qwen2.5's and Hermes' layout):

* with tools, a system turn (the conversation's own system message first, if any) lists their
  JSON schemas inside ``<tools></tools>`` and asks for
  ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``;
* an assistant turn with ``tool_calls`` writes its text, then each call in that format;
* consecutive ``tool`` messages are ``<tool_response>`` blocks inside one user turn.

Without tools it renders plain ChatML with no default system turn. The trained model is saved
with the template it was trained with, so ``generate`` and ``chat`` render what it learned.
"""

from __future__ import annotations

from pathlib import Path

_TOOLS_SYSTEM = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages and messages[0]['role'] == 'system' %}"
    "{{- messages[0]['content'] + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n\\nYou may call one or more functions to answer the user.\\n\\nThe "
    "functions are described by these JSON signatures inside <tools></tools> tags:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nTo call a function, write a JSON object with its name and arguments "
    'inside <tool_call></tool_call> tags:\\n<tool_call>\\n{"name": <function-name>, '
    '"arguments": <args-json-object>}\\n</tool_call><|im_end|>\\n\' }}'
    "{%- elif messages and messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
)
_TURNS = (
    "{%- for message in messages %}"
    "{%- if message.role == 'system' and loop.first %}"
    "{%- elif message.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}"
    "{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}"
    "{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- elif message.role == 'assistant' and message.tool_calls %}"
    "{{- '<|im_start|>assistant' }}"
    "{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}"
    "{%- for call in message.tool_calls %}"
    "{%- if call.function is defined %}{%- set call = call.function %}{%- endif %}"
    '{{- \'\\n<tool_call>\\n{"name": "\' + call.name + \'", "arguments": \' }}'
    "{{- call.arguments | tojson }}{{- '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

#: ChatML with Hermes-format tool calls (read by ``tool_call_parser: hermes``).
CHATML_TOOLS = _TOOLS_SYSTEM + _TURNS

#: The built-in templates, by the name ``tool_chat_template`` takes.
TOOL_CHAT_TEMPLATES: dict[str, str] = {"chatml_tools": CHATML_TOOLS}


def tool_chat_template(spec: str) -> str:
    """The Jinja text ``tool_chat_template`` names: a built-in (:data:`TOOL_CHAT_TEMPLATES`)
    or a file.

    Raises:
        ValueError: neither a built-in name nor a readable file.
    """
    if spec in TOOL_CHAT_TEMPLATES:
        return TOOL_CHAT_TEMPLATES[spec]
    path = Path(spec).expanduser()
    if path.is_file():
        return path.read_text(encoding="utf-8")
    raise ValueError(
        f"tool_chat_template {spec!r} is neither a built-in template "
        f"({', '.join(TOOL_CHAT_TEMPLATES)}) nor a Jinja file: use chatml_tools for a ChatML "
        "checkpoint (<|im_start|>/<|im_end|>), or the path of a template that renders tools"
    )
