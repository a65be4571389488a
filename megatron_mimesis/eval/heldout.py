"""Held-out human conversations, read and viewed exactly as ``data_prep.midtrain`` reads and renders them.

A simulator is judged where the human spoke: every turn that the mid-training data would supervise (each turn of
the speaker playing the user, the opener included) is a *position*, with the conversation so far as context.
Reading goes through data_prep's sources, record formats and user-speaker renderings rather than a second
parser, so a corpus evaluates the way it trains. With ``valid_fraction`` only the conversations that data_prep
puts in its valid split at that fraction are kept: the part of a training corpus a run never trained on.
"""

from collections import Counter
from dataclasses import dataclass, field, fields

from data_prep.pipeline import PrepConfig
from data_prep.records import FORMATS, Conversation, RecordError, decode_json_line, to_conversation
from data_prep.render import rendered_roles
from data_prep.shards import split_of
from data_prep.sources import chitchat_source, open_source

DEFAULT_VALID_FRACTION = next(f.default for f in fields(PrepConfig) if f.name == "valid_fraction")


class HeldOutError(ValueError):
    """Held-out input that cannot be used; the message is one line naming the file, line and field."""


@dataclass(frozen=True)
class Position:
    """One human turn to predict: ``context`` is the public conversation before it, as the user side sees it."""

    key: str  # "{conversation id}/{rendering}/{turn index}": stable across runs, the cache and items.jsonl key
    conversation: str  # conversation id and rendering: the unit the bootstrap resamples
    context: tuple[dict, ...]
    human: str
    last_assistant: str  # the other side's latest turn ("" at the opener)
    human_ended: bool  # the human never spoke again in this conversation, and the source says it is complete


@dataclass
class HeldOut:
    renderings: list[tuple[Conversation, list[str], str]]  # (conversation, its roles as rendered, unit) each
    positions: list[Position]
    complete: bool  # the records are whole conversations (data_prep.records.RecordFormat.complete)
    skipped: Counter = field(default_factory=Counter)  # bad records of the embedded corpus, by reason


def read_conversations(inputs: list[str], record_format: str = "messages", user_speaker: str | None = None,
                       valid_fraction: float | None = None, max_conversations: int | None = None,
                       split: str = "train", **field_overrides: str | bool | None) -> HeldOut:
    """The held-out set of ``inputs`` (empty: the embedded chit-chat corpus, whose known bad records are skipped
    and counted as data_prep does; in any given input the first bad record is an error). ``max_conversations``
    reads only the first N records of each corpus, as data_prep's flag of that name does, so a dataset built
    with it has its held-out part here."""
    embedded = not inputs
    if embedded:
        sources = [chitchat_source()]
        fmt = FORMATS["chitchat"].with_overrides(complete=field_overrides.get("complete"))
        valid_fraction = DEFAULT_VALID_FRACTION if valid_fraction is None else valid_fraction
    else:
        try:
            sources = [open_source(path, split) for path in inputs]
        except FileNotFoundError as err:
            raise HeldOutError(str(err)) from None
        fmt = FORMATS[record_format].with_overrides(**field_overrides)
    user_speaker = user_speaker or ("both" if embedded else "role")
    held_out = HeldOut([], [], fmt.complete)
    for source in sources:
        for count, (location, raw) in enumerate(source.records()):
            if max_conversations is not None and count >= max_conversations:
                break
            try:
                record = decode_json_line(raw, location) if isinstance(raw, bytes) else raw
                conversation = to_conversation(record, location, fmt)
            except RecordError as err:
                if not embedded:
                    raise HeldOutError(str(err)) from None
                held_out.skipped[err.reason] += 1
                continue
            if valid_fraction is not None and split_of(conversation.id, valid_fraction) != "valid":
                continue
            for rendering, roles in enumerate(rendered_roles(conversation.turns, user_speaker)):
                unit = f"{conversation.id}/{rendering}"
                held_out.renderings.append((conversation, roles, unit))
                held_out.positions += positions_of(conversation, roles, unit, fmt.complete)
    if not held_out.positions:
        where = "the embedded corpus" if embedded else ", ".join(inputs)
        raise HeldOutError(f"{where}: no human turn to evaluate" +
                           (f" in the valid split at --valid-fraction {valid_fraction}" if valid_fraction else ""))
    return held_out


def positions_of(conversation: Conversation, roles: list[str], unit: str, complete: bool) -> list[Position]:
    """Every turn rendered as the user's, with what came before it (system turn included, as in training); in a
    complete conversation the last one is where the human left."""
    messages = [{"role": role, "content": turn.content} for role, turn in zip(roles, conversation.turns, strict=True)]
    user_turns = [i for i, role in enumerate(roles) if role == "user"]
    out = []
    for i in user_turns:
        last_assistant = next((m["content"] for m in reversed(messages[:i]) if m["role"] == "assistant"), "")
        out.append(Position(f"{unit}/{i}", unit, tuple(messages[:i]), messages[i]["content"], last_assistant,
                            human_ended=complete and i == user_turns[-1]))
    return out
