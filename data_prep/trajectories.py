"""Agent trajectories in OpenAI's chat format -> validated records for agent SFT (``data_prep.agent_sft``).

A record is one trajectory, one JSON object per line::

    {"id"?: str, "tools"?: [tool schema, ...], "messages": [
      {"role": "system", "content": str},                                  # optional, first only
      {"role": "user", "content": str},
      {"role": "assistant", "content": str, "reasoning_content"?: str,
       "tool_calls"?: [{"id"?: str, "type": "function", "function": {"name": str, "arguments": str | object}}]},
      {"role": "tool", "tool_call_id"?: str, "content": str}, ...]}

This is what OpenAI's API and vLLM's server return and what tool-use trajectory sets publish. A tool schema is
OpenAI's (``{"type": "function", "function": {...}}``) or the bare function object. ``arguments`` may be the API's
JSON string or an object; either way it must hold a JSON object. An assistant's thinking is ``reasoning_content``
(vLLM's reasoning parser) or a ``<think>...</think>`` block at the start of its content, which is moved there.

Every problem raises ``data_prep.records.RecordError`` with the reason the manifest counts it under and the record's
``file:line`` and field, as the conversation readers do.
"""

import json
from dataclasses import dataclass

from data_prep.records import (
    EMPTY_CONTENT,
    MISSING_FIELD,
    NON_ALTERNATING,
    UNKNOWN_ROLE,
    WRONG_TYPE,
    RecordError,
    content_id,
)
from data_prep.tokenizer import END_THINK, ENDOFTEXT, IM_END, IM_START, THINK

BAD_TOOL_CALL = "bad_tool_call"  # a call without a name, or arguments that are not a JSON object
ORPHAN_TOOL_RESULT = "orphan_tool_result"  # a tool message with no call before it to answer
SPECIAL_TOKEN = "special_token"  # content that spells the template's own markers would change the rendering
ROLES = ("system", "user", "assistant", "tool")
_MARKERS = (IM_START, IM_END, ENDOFTEXT)


@dataclass(frozen=True)
class Trajectory:
    id: str
    messages: tuple[dict, ...]  # normalised: tool calls as {"type", "function": {"name", "arguments": dict}}
    tools: tuple[dict, ...] | None  # OpenAI tool schemas, or None


def to_trajectory(record: object, location: str) -> Trajectory:
    """Validate one record and return it normalised for the chat template."""
    if not isinstance(record, dict):
        raise RecordError(WRONG_TYPE, location, "<record>", f"expected an object, got {type(record).__name__}")
    raw = record.get("messages")
    if raw is None:
        raise RecordError(MISSING_FIELD, location, "messages", "missing")
    if not isinstance(raw, list):
        raise RecordError(WRONG_TYPE, location, "messages", f"expected list, got {type(raw).__name__}")
    messages = []
    open_calls = 0  # calls of the last assistant message that no tool message answered yet
    for index, message in enumerate(raw):
        path = f"messages[{index}]"
        if not isinstance(message, dict):
            raise RecordError(WRONG_TYPE, location, path, f"expected an object, got {type(message).__name__}")
        role = message.get("role")
        if role not in ROLES:
            raise RecordError(UNKNOWN_ROLE, location, f"{path}.role", f"unknown role {role!r} ({', '.join(ROLES)})")
        if role == "system" and index > 0:
            raise RecordError(NON_ALTERNATING, location, path, "system message after the start")
        content = _content(message, role, location, path)
        if role == "tool":
            if open_calls == 0:
                raise RecordError(ORPHAN_TOOL_RESULT, location, path, "a tool result with no tool call to answer")
            open_calls -= 1
            messages.append({"role": "tool", "content": content})
            continue
        open_calls = 0
        if role != "assistant":
            messages.append({"role": role, "content": content})
            continue
        entry = _assistant(message, content, location, path)
        open_calls = len(entry.get("tool_calls", ()))
        messages.append(entry)
    if not messages:
        raise RecordError(EMPTY_CONTENT, location, "messages", "no messages")
    return Trajectory(_id(record, messages, location), tuple(messages), _tools(record.get("tools"), location))


def _content(message: dict, role: str, location: str, path: str) -> str:
    content = message.get("content")
    if content is None and role == "assistant" and message.get("tool_calls"):
        content = ""  # the API's content of a message that only calls tools
    if content is None:
        raise RecordError(MISSING_FIELD, location, f"{path}.content", "missing")
    if not isinstance(content, str):
        raise RecordError(WRONG_TYPE, location, f"{path}.content", f"expected str, got {type(content).__name__}")
    for marker in _MARKERS:
        if marker in content:
            raise RecordError(SPECIAL_TOKEN, location, f"{path}.content", f"contains the template marker {marker}")
    if role in ("system", "user") and not content.strip():
        raise RecordError(EMPTY_CONTENT, location, f"{path}.content", "empty")
    return content


def _assistant(message: dict, content: str, location: str, path: str) -> dict:
    reasoning = message.get("reasoning_content")
    if reasoning is not None and not isinstance(reasoning, str):
        raise RecordError(WRONG_TYPE, location, f"{path}.reasoning_content",
                          f"expected str, got {type(reasoning).__name__}")
    if content.lstrip().startswith(THINK) and END_THINK in content:
        if reasoning is not None:
            raise RecordError(WRONG_TYPE, location, f"{path}.content",
                              "thinking both in reasoning_content and in a <think> block")
        thought, _, content = content.lstrip().removeprefix(THINK).partition(END_THINK)
        reasoning, content = thought.strip("\n"), content.lstrip("\n")
    elif THINK in content or END_THINK in content:
        raise RecordError(WRONG_TYPE, location, f"{path}.content", "a think marker that does not open the content")
    calls = message.get("tool_calls") or []
    if not isinstance(calls, list):
        raise RecordError(WRONG_TYPE, location, f"{path}.tool_calls", f"expected list, got {type(calls).__name__}")
    if not calls and not content.strip():
        raise RecordError(EMPTY_CONTENT, location, f"{path}.content", "empty, and no tool calls")
    entry = {"role": "assistant", "content": content}
    if calls:
        entry["tool_calls"] = [_call(call, location, f"{path}.tool_calls[{i}]") for i, call in enumerate(calls)]
    if reasoning:
        entry["reasoning_content"] = reasoning
    return entry


def _call(call: object, location: str, path: str) -> dict:
    function = call.get("function", call) if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"]:
        raise RecordError(BAD_TOOL_CALL, location, f"{path}.function.name", "a tool call needs a function name")
    arguments = function.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError as err:
            raise RecordError(BAD_TOOL_CALL, location, f"{path}.function.arguments",
                              f"not JSON: {err.msg} at column {err.colno}") from None
    if not isinstance(arguments, dict):
        raise RecordError(BAD_TOOL_CALL, location, f"{path}.function.arguments",
                          f"expected a JSON object, got {type(arguments).__name__}")
    return {"type": "function", "function": {"name": function["name"], "arguments": arguments}}


def _tools(tools: object, location: str) -> tuple[dict, ...] | None:
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise RecordError(WRONG_TYPE, location, "tools", f"expected list, got {type(tools).__name__}")
    schemas = []
    for index, tool in enumerate(tools):
        function = tool.get("function", tool) if isinstance(tool, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise RecordError(WRONG_TYPE, location, f"tools[{index}]", "expected a tool schema with a function name")
        schemas.append({"type": "function", "function": function})
    return tuple(schemas) or None


def _id(record: dict, messages: list[dict], location: str) -> str:
    raw = record.get("id")
    if raw is None:
        return content_id(messages)
    if not isinstance(raw, str | int):
        raise RecordError(WRONG_TYPE, location, "id", f"expected a string, got {type(raw).__name__}")
    return str(raw)
