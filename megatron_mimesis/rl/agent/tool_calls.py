"""Qwen3.5's tool-calling text format, for agent contexts and for parsing what the agent generates.

The tools are listed in the system message as JSON schemas inside ``<tools>``; a call is written as
``<tool_call>\\n<function=NAME>\\n<parameter=ARG>\\nVALUE\\n</parameter>\\n</function>\\n</tool_call>`` (the XML
format of Qwen3-Coder, which Qwen3.5 uses); tool results go back inside a user turn as
``<tool_response>\\n...\\n</tool_response>`` blocks. Parameter values that parse as JSON are taken as JSON
(numbers, lists, objects), anything else as a string, as vLLM's qwen3_coder parser does. A ``<tool_call>``
block without a well-formed ``<function=...>`` is not a call: it stays in the message text, which is what a
deployed parser would show the user.
"""

import json
import re

from megatron_mimesis.rl.envs.base import ToolCall

_CALL = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)
_FUNCTION = re.compile(r"^\s*<function=([^>\n]+)>(.*?)(?:</function>\s*)?$", re.DOTALL)
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>", re.DOTALL)

TOOLS_HEADER = (
    "# Tools\n\nYou have access to the following functions:\n\n<tools>\n{tools}\n</tools>\n\n"
    "If you choose to call a function, reply in the following format:\n\n<tool_call>\n<function=example_function>\n"
    "<parameter=example_parameter>\nvalue\n</parameter>\n</function>\n</tool_call>"
)


def tools_system_text(tools: list[dict]) -> str:
    """The tool block appended to an agent's system prompt."""
    return TOOLS_HEADER.format(tools="\n".join(json.dumps({"type": "function", "function": t}) for t in tools))


def format_tool_calls(calls: list[ToolCall]) -> str:
    blocks = []
    for call in calls:
        params = "".join(
            f"<parameter={name}>\n{value if isinstance(value, str) else json.dumps(value)}\n</parameter>\n"
            for name, value in call.arguments.items()
        )
        blocks.append(f"<tool_call>\n<function={call.name}>\n{params}</function>\n</tool_call>")
    return "\n".join(blocks)


def _value(text: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def parse_tool_calls(text: str, id_prefix: str) -> tuple[str, list[ToolCall]]:
    """Split an agent's public text into ``(message text, calls)``; call ids are ``{id_prefix}-{k}``."""
    calls = []

    def take(match: re.Match) -> str:
        function = _FUNCTION.match(match.group(1))
        if function is None:
            return match.group(0)
        arguments = {name.strip(): _value(value) for name, value in _PARAMETER.findall(function.group(2))}
        calls.append(ToolCall(function.group(1).strip(), arguments, f"{id_prefix}-{len(calls)}"))
        return ""

    return _CALL.sub(take, text).strip(), calls


def format_tool_responses(results: list[str]) -> str:
    return "\n".join(f"<tool_response>\n{r}\n</tool_response>" for r in results)
