"""How the agent's contexts are written and its generations read, in its model family's own chat format.

The family says how (``ChatFormat``, ``models/family.py``); nothing here names a family:

* **piecewise** (Qwen3.5): the ChatML layout of the training data, each piece encoded on its own
  (:class:`~megatron_mimesis.rl.chat.ChatRenderer`): the tools listed in the system message, tool calls written out
  in the assistant's content, tool results as a user turn of ``<tool_response>`` blocks; the agent's earlier thinking
  is never shown back, and with thinking on the generation prompt opens the think block.
* **own template** (Qwen3): the tokenizer's own chat template (a released checkpoint carries it in
  ``tokenizer_config.json``) renders OpenAI-style messages with ``tools``, assistant ``tool_calls``, ``tool`` messages
  and ``enable_thinking``. The agent's reasoning is kept beside each of its messages and handed to the template as
  ``reasoning_content``, so the template decides what the model saw of it (Qwen3's keeps it only after the last user
  query, within the current tool chain, and strips it from earlier turns), as it would in deployment.

Either way every generation's training row is the token ids the engine was given and the ids it generated
(``episodes.AgentTurn``), never a re-rendering of the history: a template that strips earlier thoughts would not
give back the tokens the model produced.

Privileged information has one way in: every agent context is checked on its way to the engine
(:func:`check_agent_context`): no think marker from anyone but the agent itself, no coach-note header, and no field
beyond what the format renders. A violation is a hard error.
"""

from dataclasses import dataclass

from megatron_mimesis.rl.agent.tool_calls import (
    TOOL_CALL_PARSERS,
    ParsedCalls,
    XmlCalls,
    format_tool_responses,
    parse_tool_calls,
    tools_system_text,
)
from megatron_mimesis.rl.chat import END_THINK, THINK, ChatRenderer, PrivilegedTextLeak, strip_thinking
from megatron_mimesis.rl.envs.base import EnvTask

NOTE_HEADER = "# Coach's note"  # opens a coach's note in a teacher context; never allowed in an agent context
_FIELDS = {"system": {"role", "content"}, "user": {"role", "content"}, "tool": {"role", "content"},
           "assistant": {"role", "content", "tool_calls", "reasoning_content"}}


@dataclass(frozen=True)
class AgentReply:
    """One generation, read: private thinking (kept for the agent's own later contexts, where its format shows it),
    the public text, the tool calls, and the ``<tool_call>`` blocks that did not parse."""

    thinking: str | None
    text: str
    calls: list
    unparsed_calls: int


def check_agent_context(view: list[dict]) -> None:
    """Raise ``PrivilegedTextLeak`` unless the view holds only the fields its format renders, no think marker outside
    the agent's own reasoning, and no coach's note."""
    for index, message in enumerate(view):
        role = message["role"]
        extra = set(message) - _FIELDS.get(role, set())
        if extra:
            raise PrivilegedTextLeak(f"agent context message {index} ({role}) carries fields {sorted(extra)}")
        content = message["content"]
        if THINK in content or END_THINK in content:
            raise PrivilegedTextLeak(f"agent context message {index} ({role}) contains a think marker")
        if NOTE_HEADER in content or NOTE_HEADER in (message.get("reasoning_content") or ""):
            raise PrivilegedTextLeak(f"agent context message {index} ({role}) contains a coach's note")


def shown(message: dict, calls) -> str:
    """An assistant message as a context (or the coach) shows it: its text, then its calls in the format's text."""
    tool_calls = message.get("tool_calls") or []
    return "\n\n".join(p for p in (message["content"], calls.format(tool_calls) if tool_calls else "") if p)


def _with_note(view: list[dict], note: str | None) -> list[dict]:
    """The teacher's view: the student's with ``note`` appended to the system message (after the check)."""
    if note is None:
        return view
    return [{**view[0], "content": f"{view[0]['content']}\n\n{NOTE_HEADER}\n{note}"}, *view[1:]]


class PiecewiseAgentChat:
    """ChatML rendered piece by piece (the training data's layout), the qwen3_coder tool format."""

    calls = XmlCalls

    def __init__(self, tokenizer, thinking: bool):
        self.renderer = ChatRenderer(tokenizer, thinking)
        self.tokenizer = tokenizer
        self.stop_token_ids = self.renderer.stop_token_ids

    def view(self, task: EnvTask, messages: list[dict], agent_thinking: dict | None = None) -> list[dict]:
        """The public messages of the context: tool calls written out in the assistant's content, consecutive tool
        results joined into one user turn of ``<tool_response>`` blocks; the agent's thinking is not shown back."""
        system = task.agent_system_prompt + ("\n\n" + tools_system_text(task.tools) if task.tools else "")
        view = [{"role": "system", "content": system}]
        pending: list[str] = []
        for message in messages:
            if message["role"] == "tool":
                pending.append(message["content"])
                continue
            if pending:
                view.append({"role": "user", "content": format_tool_responses(pending)})
                pending = []
            view.append({"role": message["role"], "content": shown(message, self.calls)})
        if pending:
            view.append({"role": "user", "content": format_tool_responses(pending)})
        return view

    def context(self, task: EnvTask, messages: list[dict], agent_thinking: dict | None = None,
                note: str | None = None) -> list[int]:
        view = self.view(task, messages, agent_thinking)
        check_agent_context(view)
        return self.renderer.assistant_prompt(_with_note(view, note))

    def prompt(self, messages: list[dict]) -> list[int]:
        """A plain chat's generation prompt (the policy writing a coach's note)."""
        return self.renderer.assistant_prompt(messages)

    def read(self, text: str, id_prefix: str) -> AgentReply:
        thinking, public = self.renderer.split_thinking(text)
        parsed = parse_tool_calls(public, id_prefix, self.calls)
        return AgentReply(thinking, parsed.text, parsed.calls, parsed.unparsed)


class TemplateAgentChat:
    """The tokenizer's own chat template over OpenAI-style messages, the family's tool-call parser."""

    def __init__(self, tokenizer, thinking: bool, calls, opens_think_in_prompt: bool):
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError(f"{getattr(tokenizer, 'name_or_path', 'the tokenizer')}: no chat template (a released "
                             f"checkpoint's tokenizer_config.json carries it; this family renders agent contexts "
                             f"with it)")
        self.tokenizer = tokenizer
        self.thinking = thinking
        self.calls = calls
        self.opens_think_in_prompt = opens_think_in_prompt
        # the turn ends as ChatML's: the template's own end token, and the end-of-text token
        self.stop_token_ids = ChatRenderer(tokenizer, thinking).stop_token_ids

    def view(self, task: EnvTask, messages: list[dict], agent_thinking: dict | None = None) -> list[dict]:
        """The OpenAI-style messages the template renders; the agent's reasoning beside its own messages."""
        agent_thinking = agent_thinking or {}
        view = [{"role": "system", "content": task.agent_system_prompt}]
        for index, message in enumerate(messages):
            entry = {"role": message["role"], "content": message["content"]}
            if message["role"] == "assistant":
                if message.get("tool_calls"):
                    entry["tool_calls"] = [{"type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                                           for c in message["tool_calls"]]
                if agent_thinking.get(index):
                    entry["reasoning_content"] = agent_thinking[index]
            view.append(entry)
        return view

    def _render(self, view: list[dict], tools: list[dict] | None) -> list[int]:
        text = self.tokenizer.apply_chat_template(
            view, tools=[{"type": "function", "function": t} for t in tools] if tools else None, tokenize=False,
            add_generation_prompt=True, enable_thinking=self.thinking)
        return self.tokenizer.encode(text, add_special_tokens=False)

    def context(self, task: EnvTask, messages: list[dict], agent_thinking: dict | None = None,
                note: str | None = None) -> list[int]:
        view = self.view(task, messages, agent_thinking)
        check_agent_context(view)
        return self._render(_with_note(view, note), task.tools)

    def prompt(self, messages: list[dict]) -> list[int]:
        return self._render(messages, None)

    def read(self, text: str, id_prefix: str) -> AgentReply:
        text = text.strip()
        for stop in self.tokenizer.convert_ids_to_tokens(list(self.stop_token_ids)):
            text = text.removesuffix(stop)
        opened = self.thinking and self.opens_think_in_prompt
        thinking, public = strip_thinking(THINK + text if opened else text)
        parsed: ParsedCalls = parse_tool_calls(public, id_prefix, self.calls)
        return AgentReply(thinking, parsed.text, parsed.calls, parsed.unparsed)


def agent_chat(chat_format, tokenizer, thinking: bool):
    """The agent chat of a family's ``ChatFormat`` (``preset.family.chat``) over ``tokenizer``."""
    calls = TOOL_CALL_PARSERS[chat_format.tool_call_parser]
    if chat_format.own_template:
        return TemplateAgentChat(tokenizer, thinking, calls, chat_format.opens_think_in_prompt)
    if calls is not XmlCalls or not chat_format.opens_think_in_prompt:
        raise ValueError(f"a piecewise agent chat writes qwen3_coder tool calls and opens the think block in the "
                         f"prompt, not {chat_format}")
    return PiecewiseAgentChat(tokenizer, thinking)
