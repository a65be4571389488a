"""Raw records -> validated conversations.

A conversation is ``{"messages": [{"role": "user"|"assistant"|"system", "content": str, "thinking"?: str}],
"id"?: str}``. Other shapes are mapped onto it by an explicit ``RecordFormat`` chosen on the command line
(``--format messages|sharegpt|chitchat`` plus per-field overrides); nothing is guessed, so a corpus in an
unexpected shape fails loudly instead of silently producing empty samples.

Double-texting (two messages in a row from one speaker, as chat logs record each message sent) is a
``non_alternating`` record unless ``--double-texting merge`` is given: then a run of one speaker's messages becomes one
turn, the messages joined by a newline (as the chit-chat corpus joins a speaker's lines), their thinking likewise.

Every problem raises ``RecordError`` carrying a reason (the key counted in the manifest under ``skipped``)
and a location ``file:line`` / ``file:row`` plus the field path, so a user can open the file at the spot.
"""

import hashlib
import json
from dataclasses import dataclass, field, replace

CANONICAL_ROLES = ("system", "user", "assistant")

# Reasons a record is rejected; the manifest counts skipped records under exactly these keys.
MALFORMED_JSON = "malformed_json"
INVALID_UTF8 = "invalid_utf8"
MISSING_FIELD = "missing_field"
WRONG_TYPE = "wrong_type"
UNKNOWN_ROLE = "unknown_role"
EMPTY_CONTENT = "empty_content"
NON_ALTERNATING = "non_alternating"

DOUBLE_TEXTING = ("reject", "merge")  # what a run of one speaker's messages becomes: a bad record, or one turn


class RecordError(ValueError):
    """A record that cannot become a conversation; ``str()`` names file, line/row and field."""

    def __init__(self, reason: str, location: str, field_path: str, detail: str):
        super().__init__(f"{location}: {field_path}: {detail} [{reason}]")
        self.reason = reason
        self.location = location
        self.field_path = field_path


@dataclass(frozen=True)
class Turn:
    role: str
    content: str
    thinking: str | None = None


@dataclass(frozen=True)
class Conversation:
    id: str
    turns: tuple[Turn, ...]


@dataclass(frozen=True)
class RecordFormat:
    """Where the conversation lives in a record and how its role names map to the canonical ones, and whether a
    record is a *complete* conversation (kept to where the people stopped, so its last user turn is where the
    user left: ``data_prep.render`` trains the end marker there). The formats' defaults: the chit-chat corpus
    holds whole chats; ``messages`` is the shape of conversation logs (WildChat, LMSYS-Chat-1M), whole; the
    ShareGPT dumps in circulation split long conversations into parts that fit a context (Vicuna's cleaning), so
    ``sharegpt`` is not. ``--complete`` overrides it per input."""

    messages_field: str = "messages"
    role_field: str = "role"
    content_field: str = "content"
    thinking_field: str = "thinking"
    id_field: str = "id"
    role_names: dict[str, str] = field(default_factory=lambda: {r: r for r in CANONICAL_ROLES})
    chitchat: bool = False
    complete: bool = True
    double_texting: str = "reject"

    def with_overrides(self, **fields: str | None) -> "RecordFormat":
        """Apply ``--messages-field`` etc.; ``None`` keeps the format's own default."""
        return replace(self, **{k: v for k, v in fields.items() if v is not None})


FORMATS = {
    "messages": RecordFormat(),
    "sharegpt": RecordFormat(
        messages_field="conversations",
        role_field="from",
        content_field="value",
        role_names={"system": "system", "human": "user", "gpt": "assistant"},
        complete=False,
    ),
    # chitchat-dataset: {"messages": [[{"sender", "text"}, ...], ...]}, one inner list per turn, two senders.
    # The first sender becomes "user", the second "assistant"; an utterance's lines are joined by "\n".
    "chitchat": RecordFormat(chitchat=True),
}


def decode_json_line(line: bytes, location: str) -> dict:
    """Parse one JSONL line, separating bad bytes from bad JSON because they have different fixes."""
    try:
        text = line.decode("utf-8")
    except UnicodeDecodeError as err:
        raise RecordError(INVALID_UTF8, location, "<line>", f"invalid UTF-8 at byte {err.start}") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        raise RecordError(
            MALFORMED_JSON, location, "<line>", f"malformed JSON: {err.msg} at column {err.colno}"
        ) from None


def to_conversation(record: object, location: str, fmt: RecordFormat) -> Conversation:
    """Validate one record and return it as a canonical conversation."""
    if not isinstance(record, dict):
        raise RecordError(WRONG_TYPE, location, "<record>", f"expected an object, got {type(record).__name__}")
    messages = _require(record, fmt.messages_field, list, location, fmt.messages_field)
    turns = _chitchat_turns(messages, location) if fmt.chitchat else _message_turns(messages, location, fmt)
    if fmt.double_texting == "merge":
        turns = _merge_runs(turns)
    _check_order(turns, location, fmt.messages_field)
    raw_id = record.get(fmt.id_field)
    if raw_id is None:
        conversation_id = content_id([[t.role, t.content, t.thinking] for t in turns])
    elif isinstance(raw_id, str | int):
        conversation_id = str(raw_id)
    else:
        raise RecordError(WRONG_TYPE, location, fmt.id_field, f"expected a string, got {type(raw_id).__name__}")
    return Conversation(conversation_id, tuple(turns))


def _require(obj: dict, key: str, kind: type, location: str, path: str):
    if key not in obj or obj[key] is None:
        raise RecordError(MISSING_FIELD, location, path, "missing")
    value = obj[key]
    if not isinstance(value, kind):
        raise RecordError(WRONG_TYPE, location, path, f"expected {kind.__name__}, got {type(value).__name__}")
    return value


def _text(value: str, location: str, path: str) -> str:
    if not value.strip():
        raise RecordError(EMPTY_CONTENT, location, path, "empty")
    if not value.isascii():
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as err:
            raise RecordError(INVALID_UTF8, location, path, f"not encodable as UTF-8 at {err.start}") from None
    return value


def _message_turns(messages: list, location: str, fmt: RecordFormat) -> list[Turn]:
    turns = []
    for i, message in enumerate(messages):
        path = f"{fmt.messages_field}[{i}]"
        if not isinstance(message, dict):
            raise RecordError(WRONG_TYPE, location, path, f"expected an object, got {type(message).__name__}")
        role = _require(message, fmt.role_field, str, location, f"{path}.{fmt.role_field}")
        if role not in fmt.role_names:
            known = ", ".join(sorted(fmt.role_names))
            raise RecordError(UNKNOWN_ROLE, location, f"{path}.{fmt.role_field}", f"unknown role {role!r} ({known})")
        content_path = f"{path}.{fmt.content_field}"
        content = _text(_require(message, fmt.content_field, str, location, content_path), location, content_path)
        thinking = message.get(fmt.thinking_field)
        if thinking is not None:
            thinking_path = f"{path}.{fmt.thinking_field}"
            if not isinstance(thinking, str):
                raise RecordError(WRONG_TYPE, location, thinking_path, f"expected str, got {type(thinking).__name__}")
            thinking = _text(thinking, location, thinking_path)
        turns.append(Turn(fmt.role_names[role], content, thinking))
    return turns


def _chitchat_turns(messages: list, location: str) -> list[Turn]:
    senders: list[str] = []
    turns: list[Turn] = []
    for i, group in enumerate(messages):
        path = f"messages[{i}]"
        if not isinstance(group, list) or not group or not isinstance(group[0], dict):
            raise RecordError(WRONG_TYPE, location, path, "expected a non-empty list of utterances")
        sender = _require(group[0], "sender", str, location, f"{path}[0].sender")
        lines = []
        for j, utterance in enumerate(group):
            if (
                not isinstance(utterance, dict)
                or utterance.get("sender") != sender
                or not isinstance(utterance.get("text"), str)
            ):
                _raise_chitchat_utterance_error(utterance, sender, location, f"{path}[{j}]")
            if utterance["text"].strip():
                lines.append(utterance["text"])
        if sender not in senders:
            if len(senders) == 2:
                raise RecordError(UNKNOWN_ROLE, location, f"{path}[0].sender", "a third speaker")
            senders.append(sender)
        content = _text("\n".join(lines), location, f"{path}[*].text")
        turns.append(Turn("user" if sender == senders[0] else "assistant", content))
    return turns


def _raise_chitchat_utterance_error(utterance: object, sender: str, location: str, path: str) -> None:
    """The precise error for an utterance that failed the fast check in ``_chitchat_turns``."""
    if not isinstance(utterance, dict):
        raise RecordError(WRONG_TYPE, location, path, "expected an object")
    if _require(utterance, "sender", str, location, f"{path}.sender") != sender:
        raise RecordError(NON_ALTERNATING, location, f"{path}.sender", "two speakers in one turn")
    _require(utterance, "text", str, location, f"{path}.text")


def _merge_runs(turns: list[Turn]) -> list[Turn]:
    """Each run of consecutive turns of one role as one turn (the ``--double-texting merge`` rule)."""
    merged: list[Turn] = []
    for turn in turns:
        if merged and merged[-1].role == turn.role:
            last = merged[-1]
            thinking = "\n".join(t for t in (last.thinking, turn.thinking) if t is not None) or None
            merged[-1] = Turn(turn.role, f"{last.content}\n{turn.content}", thinking)
        else:
            merged.append(turn)
    return merged


def _check_order(turns: list[Turn], location: str, messages_field: str) -> None:
    """A system turn may only open the conversation; user and assistant must alternate."""
    roles = [t.role for t in turns]
    if all(role == "system" for role in roles):
        raise RecordError(EMPTY_CONTENT, location, messages_field, "no user or assistant turn")
    for i in range(1, len(roles)):
        if roles[i] == "system":
            raise RecordError(NON_ALTERNATING, location, f"{messages_field}[{i}]", "system turn after the start")
        if roles[i] == roles[i - 1]:
            raise RecordError(NON_ALTERNATING, location, f"{messages_field}[{i}]", f"two {roles[i]} turns in a row "
                              "(--double-texting merge makes them one)")


def content_id(content: object) -> str:
    """Records without an id get one from their content, so the split stays stable when files are reordered."""
    payload = json.dumps(content, ensure_ascii=False)
    return "sha1:" + hashlib.sha1(payload.encode("utf-8")).hexdigest()
