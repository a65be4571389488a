"""Held-out human conversations, read and viewed exactly as ``data_prep.midtrain`` reads and renders them.

A simulator is judged where the human spoke: every turn that the mid-training data would supervise (each turn of
the speaker playing the user, the opener included) is a *position*, with the conversation so far as context.
Reading goes through data_prep's sources, record formats and user-speaker renderings rather than a second
parser, so a corpus evaluates the way it trains. With ``valid_fraction`` only the conversations that data_prep
puts in its valid split at that fraction are kept: the part of a training corpus a run never trained on. A
data_prep manifest gives all of that per corpus (:func:`manifest_corpora`), so its held-out split is read with the
settings it was built with, and an input can be checked against its training split (:func:`training_overlap`).
"""

import json
from collections import Counter
from dataclasses import dataclass, field, fields
from pathlib import Path

from data_prep.pipeline import PrepConfig
from data_prep.records import FORMATS, Conversation, RecordError, RecordFormat, decode_json_line, to_conversation
from data_prep.render import rendered_roles
from data_prep.shards import split_of
from data_prep.sources import Source, chitchat_source, open_source

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


@dataclass(frozen=True)
class Rendering:
    """One conversation with the user role given to one of its speakers."""

    conversation: Conversation
    roles: list[str]
    unit: str
    complete: bool  # the record is a whole conversation (data_prep.records.RecordFormat.complete)


@dataclass(frozen=True)
class Corpus:
    """One input and how to read it: as data_prep reads a corpus, and which of its conversations to keep."""

    source: Source
    fmt: RecordFormat
    user_speaker: str
    on_error: str  # a bad record stops the read ("fail") or is skipped and counted by reason ("skip")
    valid_fraction: float | None = None  # keep only data_prep's valid split at this fraction (None: all)
    max_conversations: int | None = None  # read only the first N records, as data_prep's flag of that name

    def conversations(self, skipped: Counter):
        """(conversation, its split) of every good record; bad ones are counted in ``skipped`` by reason."""
        for count, (location, raw) in enumerate(self.source.records()):
            if self.max_conversations is not None and count >= self.max_conversations:
                return
            try:
                record = decode_json_line(raw, location) if isinstance(raw, bytes) else raw
                conversation = to_conversation(record, location, self.fmt)
            except RecordError as err:
                if self.on_error != "skip":
                    raise HeldOutError(f"{err} (--on-error skip skips and counts such records)") from None
                skipped[err.reason] += 1
                continue
            yield conversation, split_of(conversation.id, self.valid_fraction or 0.0)


@dataclass
class HeldOut:
    renderings: list[Rendering]
    positions: list[Position]
    skipped: Counter = field(default_factory=Counter)  # bad records, by reason (data_prep.records' reasons)
    conversation_ids: set[str] = field(default_factory=set)
    training_overlap: int | None = None  # conversations in a given manifest's training split (None: none given)


def input_corpora(inputs: list[str], record_format: str = "messages", user_speaker: str | None = None,
                  valid_fraction: float | None = None, max_conversations: int | None = None, split: str = "train",
                  on_error: str | None = None, **field_overrides: str | bool | None) -> list[Corpus]:
    """``--input`` files as corpora. None: the embedded chit-chat corpus, whose valid split at data_prep's default
    fraction is its held-out part and whose known bad records are skipped, as data_prep does."""
    if not inputs:
        fmt = FORMATS["chitchat"].with_overrides(complete=field_overrides.get("complete"),
                                                 double_texting=field_overrides.get("double_texting"))
        fraction = DEFAULT_VALID_FRACTION if valid_fraction is None else valid_fraction
        return [Corpus(chitchat_source(), fmt, user_speaker or "both", on_error or "skip", fraction,
                       max_conversations)]
    try:
        sources = [open_source(path, split) for path in inputs]
    except FileNotFoundError as err:
        raise HeldOutError(str(err)) from None
    fmt = FORMATS[record_format].with_overrides(**field_overrides)
    return [Corpus(source, fmt, user_speaker or "role", on_error or "fail", valid_fraction, max_conversations)
            for source in sources]


def manifest_corpora(path: Path, on_error: str | None = None) -> list[Corpus]:
    """The corpora of a data_prep manifest (``manifest.json`` of a build), each restricted to its held-out (valid)
    split and read with the settings it was built with (bad records as it treated them, unless ``on_error``)."""
    try:
        manifest = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise HeldOutError(f"--manifest {path}: no such file") from None
    except json.JSONDecodeError as err:
        raise HeldOutError(f"--manifest {path}: not JSON ({err.msg} at line {err.lineno})") from None
    if not isinstance(manifest, dict) or not isinstance(manifest.get("corpora"), dict):
        raise HeldOutError(f"--manifest {path}: no 'corpora' (expected the manifest.json data_prep writes)")
    corpora = []
    for name, corpus in manifest["corpora"].items():
        if "record_format" not in corpus:
            raise HeldOutError(f"--manifest {path}: corpora.{name} has no record_format (written by an older "
                               "data_prep; build it again)")
        source = corpus["source"]
        if not Path(source["path"]).exists() and source["kind"] != "datasets":
            raise HeldOutError(f"--manifest {path}: corpora.{name}.source.path {source['path']}: no such file")
        fmt = RecordFormat(**corpus["record_format"])
        corpora.append(Corpus(Source(name, source["path"], source["kind"], corpus.get("split", "train")), fmt,
                              corpus["user_speaker"], on_error or corpus["on_error"], corpus["valid_fraction"],
                              corpus.get("max_conversations")))
    return corpora


def read_conversations(corpora: list[Corpus]) -> HeldOut:
    """The held-out set of ``corpora``: each kept conversation in each of its renderings, and its positions."""
    held_out = HeldOut([], [])
    for corpus in corpora:
        for conversation, split in corpus.conversations(held_out.skipped):
            if corpus.valid_fraction is not None and split != "valid":
                continue
            held_out.conversation_ids.add(conversation.id)
            for rendering, roles in enumerate(rendered_roles(conversation.turns, corpus.user_speaker)):
                unit = f"{conversation.id}/{rendering}"
                held_out.renderings.append(Rendering(conversation, roles, unit, corpus.fmt.complete))
                held_out.positions += positions_of(conversation, roles, unit, corpus.fmt.complete)
    if not held_out.positions:
        where = ", ".join(c.source.path for c in corpora)
        fractions = {c.valid_fraction for c in corpora} - {None}
        raise HeldOutError(f"{where}: no human turn to evaluate" +
                           (f" in the valid split at fraction {', '.join(map(str, fractions))}" if fractions else "") +
                           (f" (skipped records: {dict(held_out.skipped)})" if held_out.skipped else ""))
    return held_out


def training_overlap(held_out: HeldOut, corpora: list[Corpus]) -> int:
    """How many held-out conversations are in the training split of ``corpora`` (a manifest's): by conversation
    id, which is a record's own id or, without one, a hash of its content."""
    train_ids = set()
    for corpus in corpora:
        for conversation, split in corpus.conversations(Counter()):
            if split == "train":
                train_ids.add(conversation.id)
    return len(held_out.conversation_ids & train_ids)


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
