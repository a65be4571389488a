"""The tool-call text of the agent's family, for agent contexts and for parsing what the agent generates.

Two formats, named as vLLM's OpenAI server names their parsers (``--tool-call-parser``); a family says which its
chat template writes (``ChatFormat.tool_call_parser``):

* ``qwen3_coder`` (Qwen3-Coder, Qwen3.5): ``<tool_call>\\n<function=NAME>\\n<parameter=ARG>\\nVALUE\\n</parameter>\\n
  </function>\\n</tool_call>``. Parameter values that parse as JSON are taken as JSON (numbers, lists, objects),
  anything else as a string, as vLLM's qwen3_coder parser does. The tools are listed in the system message as JSON
  schemas inside ``<tools>`` (:func:`tools_system_text`) and results go back inside a user turn as
  ``<tool_response>\\n...\\n</tool_response>`` blocks.
* ``hermes`` (Qwen2.5, Qwen3): ``<tool_call>\\n{"name": NAME, "arguments": {...}}\\n</tool_call>``, one JSON object per
  block (``arguments`` may also be a JSON string, as some servers write it).

A ``<tool_call>`` block that does not parse as its format's call is not a call: it stays in the message text, which
is what a deployed parser would show the user, and is counted (``unparsed``), so a policy that drifts into
malformed calls shows in the metrics rather than as a silent loss of its tool use.
"""

import json
import re
from dataclasses import dataclass

from megatron_mimesis.rl.envs.base import ToolCall

_CALL = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)
_FUNCTION = re.compile(r"^\s*<function=([^>\n]+)>(.*?)(?:</function>\s*)?$", re.DOTALL)
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>", re.DOTALL)

TOOLS_HEADER = (
    "# Tools\n\nYou have access to the following functions:\n\n<tools>\n{tools}\n</tools>\n\n"
    "If you choose to call a function, reply in the following format:\n\n<tool_call>\n<function=example_function>\n"
    "<parameter=example_parameter>\nvalue\n</parameter>\n</function>\n</tool_call>"
)


@dataclass(frozen=True)
class ParsedCalls:
    text: str  # the message text without the parsed calls (unparsed blocks stay in it)
    calls: list[ToolCall]
    unparsed: int  # <tool_call> blocks that were not a well-formed call


def tools_system_text(tools: list[dict]) -> str:
    """The qwen3_coder tool block appended to an agent's system prompt (a piecewise-rendered context)."""
    return TOOLS_HEADER.format(tools="\n".join(json.dumps({"type": "function", "function": t}) for t in tools))


def format_tool_responses(results: list[str]) -> str:
    return "\n".join(f"<tool_response>\n{r}\n</tool_response>" for r in results)


def _json_or_text(text: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


class XmlCalls:
    name = "qwen3_coder"

    @staticmethod
    def format(calls: list[ToolCall]) -> str:
        blocks = []
        for call in calls:
            params = "".join(
                f"<parameter={name}>\n{value if isinstance(value, str) else json.dumps(value)}\n</parameter>\n"
                for name, value in call.arguments.items()
            )
            blocks.append(f"<tool_call>\n<function={call.name}>\n{params}</function>\n</tool_call>")
        return "\n".join(blocks)

    @staticmethod
    def call(block: str) -> tuple[str, dict] | None:
        function = _FUNCTION.match(block)
        if function is None:
            return None
        arguments = {name.strip(): _json_or_text(value) for name, value in _PARAMETER.findall(function.group(2))}
        return function.group(1).strip(), arguments


class JsonCalls:
    name = "hermes"

    @staticmethod
    def format(calls: list[ToolCall]) -> str:
        """As Qwen3's chat template writes them (``tool_call.arguments | tojson``)."""
        return "\n".join(f'<tool_call>\n{{"name": "{call.name}", "arguments": {json.dumps(call.arguments)}}}\n'
                         f"</tool_call>" for call in calls)

    @staticmethod
    def call(block: str) -> tuple[str, dict] | None:
        try:
            obj = json.loads(block)
            arguments = obj.get("arguments", {})
            if isinstance(arguments, str):
                arguments = json.loads(arguments)
        except (json.JSONDecodeError, AttributeError):
            return None
        if not isinstance(obj.get("name"), str) or not obj["name"] or not isinstance(arguments, dict):
            return None
        return obj["name"], arguments


TOOL_CALL_PARSERS = {parser.name: parser for parser in (XmlCalls, JsonCalls)}


def parse_tool_calls(text: str, id_prefix: str, parser=XmlCalls) -> ParsedCalls:
    """Split an agent's public text into the message text and its calls; call ids are ``{id_prefix}-{k}``."""
    calls, unparsed = [], 0

    def take(match: re.Match) -> str:
        nonlocal unparsed
        parsed = parser.call(match.group(1))
        if parsed is None:
            unparsed += 1
            return match.group(0)
        calls.append(ToolCall(*parsed, f"{id_prefix}-{len(calls)}"))
        return ""

    text = _CALL.sub(take, text).strip()
    return ParsedCalls(text, calls, unparsed)
