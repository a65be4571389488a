"""Conversations -> token samples with their target spans, in Qwen's ChatML chat template (Qwen3.5's layout).

Every turn renders as ``<|im_start|>{role}\\n{content}<|im_end|>\\n``. The model learns to play the *user*:

* mid-training (thinking off): the target is each user turn's content plus its ``<|im_end|>``; the header
  ``<|im_start|>user\\n`` and everything before it is context. A conversation that the user opens gives that
  first turn a loss too (a simulator must be able to open conversations). Turns after the last user turn
  carry no loss and are dropped.
* SFT (Qwen3.5 thinking template): the target of a supervised user turn (one that has ``thinking``) is
  ``<think>\\n{thinking}\\n</think>\\n\\n{content}<|im_end|>``. Like the template, earlier turns are shown
  without their thinking, so each supervised turn is its own sample.

The user's leaving is a target too: in a *complete* conversation (one a source records whole, to where the
people stopped) the last turn rendered as the user's is the one after which that user left, whoever spoke last
(``eval_simulator`` counts an ending the same way), so its target ends with ``END_MARKER`` (`` <END>``) before the
``<|im_end|>``: the content is rendered as ``f"{content} <END>"``. A conversation a source cut, or a
window cut out of a long one, shows no marker where it was cut. Whether a source's conversations are complete
is the source's setting (``data_prep.records.RecordFormat.complete``).

Human-human chats choose who is the user with ``user_speaker``: ``role`` keeps the roles as given, ``first`` /
``second`` make the first / second speaker the user (the other becomes the assistant), ``both`` renders the
conversation twice, once per speaker.

Limits: a sample is at most ``seq_length`` tokens. A long conversation is cut into windows at turn boundaries;
each window keeps the most recent context that fits (at most half the window in mid-training, so that a window
always makes progress on new targets) and a leading system turn when it fits. A target turn is never cut: one
longer than ``seq_length`` is dropped and counted as ``overlong_target_turns``.

Contents are encoded separately from the template pieces (one batch per shard). With the Qwen pre-tokenizer
this equals encoding the whole rendered string, except for content that starts with a newline.
"""

from dataclasses import dataclass, field

from data_prep.records import Conversation, Turn
from data_prep.tokenizer import END_THINK, IM_END, IM_START, THINK, SentencePieceEncoder, TextEncoder

USER_SPEAKERS = ("role", "first", "second", "both")
# The one marker a simulator writes to end the conversation, trained here and read by every client of the project
# (episodes, user models, evaluation); a served export maps it to a client's own (megatron_mimesis.serving).
END_MARKER = "<END>"


@dataclass(frozen=True)
class ChatTokens:
    """The template's fixed pieces, encoded once per process."""

    header: dict[str, list[int]]
    im_end: int
    newline: list[int]
    think: int
    end_think: int

    @classmethod
    def from_encoder(cls, encoder: TextEncoder | SentencePieceEncoder) -> "ChatTokens":
        roles = ("system", "user", "assistant")
        encoded = encoder.encode_batch([f"{role}\n" for role in roles] + ["\n"])
        special = encoder.special
        return cls(
            header={role: [special[IM_START], *ids] for role, ids in zip(roles, encoded, strict=False)},
            im_end=special[IM_END],
            newline=encoded[-1],
            think=special[THINK],
            end_think=special[END_THINK],
        )


# Why a rendering has no end target: its source's conversations are not complete, its last user turn is longer
# than seq_length (dropped), or (SFT) that turn has no thinking and so is no target at all.
NOT_ENDED_REASONS = ("source_incomplete", "last_turn_overlong", "last_turn_unsupervised")


@dataclass
class RenderStats:
    """Per-shard counts: samples made, renderings (conversation x user speaker) without any target turn, target
    turns dropped for being longer than ``seq_length``, and of the renderings with a target, how many end with
    the user's leaving as a target (``ended``) and why the others do not."""

    samples: int = 0
    no_target_turn: int = 0
    overlong_target_turns: int = 0
    ended: int = 0
    not_ended: dict[str, int] = field(default_factory=lambda: dict.fromkeys(NOT_ENDED_REASONS, 0))


def with_end_marker(content: str) -> str:
    return f"{content} {END_MARKER}"


def end_turns(turns: tuple[Turn, ...], user_speaker: str, complete: bool) -> list[int | None]:
    """Per rendering, the turn after which its user left (the last one rendered as the user's), or ``None`` for
    a conversation that may have gone on."""
    return [max(i for i, role in enumerate(view) if role == "user") if complete and "user" in view else None
            for view in rendered_roles(turns, user_speaker)]


def texts_to_encode(conversation: Conversation, with_thinking: bool, user_speaker: str, complete: bool) -> list[str]:
    """The strings of one conversation that need the tokenizer, in the order ``render`` consumes them: every
    content, each thinking turn's thought and utterance, then each rendering's end turn with its marker (encoded
    whole, so the target equals the encoding of the marked content in any tokenizer)."""
    turns = conversation.turns
    texts = [t.content for t in turns]
    if with_thinking:
        for turn in turns:
            if turn.thinking is not None:
                texts.append("\n" + turn.thinking.strip("\n") + "\n")
                texts.append(_utterance(turn.content))
    for end in end_turns(turns, user_speaker, complete):
        if end is not None:
            texts.append(with_end_marker(_utterance(turns[end].content) if with_thinking else turns[end].content))
    return texts


def _utterance(content: str) -> str:
    """What follows ``</think>`` in a thought-supervised target."""
    return "\n\n" + content.lstrip("\n")


def render(
    conversation: Conversation,
    encoded: list[list[int]],
    chat: ChatTokens,
    seq_length: int,
    user_speaker: str,
    with_thinking: bool,
    stats: RenderStats,
    complete: bool,
) -> list[tuple[list[int], list[tuple[int, int, int]]]]:
    """Return ``(tokens, target_spans)`` samples of one conversation; ``encoded`` follows ``texts_to_encode``
    (called with the same ``with_thinking``, ``user_speaker`` and ``complete``).

    ``target_spans`` are ``(start, end, turn)``: the token range of a target and the index of its turn (spans, not
    a per-token mask, because the shard turns them into a mask array far faster than Python builds per-token
    lists)."""
    turns = conversation.turns
    content_ids = encoded[: len(turns)]
    rest = iter(encoded[len(turns) :])
    target_bodies: list[list[int] | None] = []
    for turn, content in zip(turns, content_ids, strict=True):
        if with_thinking:
            if turn.thinking is None:
                target_bodies.append(None)
            else:
                thought, utterance = next(rest), next(rest)
                target_bodies.append([chat.think, *thought, chat.end_think, *utterance])
        else:
            target_bodies.append(content)

    samples = []
    closing = [chat.im_end, *chat.newline]
    for view, end in zip(rendered_roles(turns, user_speaker), end_turns(turns, user_speaker, complete), strict=True):
        bodies = list(target_bodies)
        if end is not None:
            marked = next(rest)
            if with_thinking and bodies[end] is not None:
                thought = bodies[end][1 : bodies[end].index(chat.end_think)]
                bodies[end] = [chat.think, *thought, chat.end_think, *marked]
            elif not with_thinking:
                bodies[end] = marked
        is_target = [role == "user" and body is not None for role, body in zip(view, bodies, strict=True)]
        if not any(is_target):
            stats.no_target_turn += 1
            continue
        frame = [len(chat.header[role]) + len(closing) for role in view]
        windows, overlong = plan_windows(
            [f + len(ids) for f, ids in zip(frame, content_ids, strict=True)],
            [f + len(body) if flag else 0 for f, body, flag in zip(frame, bodies, is_target, strict=True)],
            is_target,
            seq_length,
            pinned_system=turns[0].role == "system",
            one_target_per_window=with_thinking,
        )
        stats.overlong_target_turns += overlong
        _count_ending(stats, end, is_target, windows)
        for window in windows:
            tokens: list[int] = []
            spans: list[tuple[int, int, int]] = []
            for index, supervised in window:
                tokens += chat.header[view[index]]
                if supervised:
                    start = len(tokens)
                    tokens += bodies[index]
                    spans.append((start, len(tokens) + 1, index))  # the body and its <|im_end|>
                else:
                    tokens += content_ids[index]
                tokens += closing
            samples.append((tokens, spans))
        stats.samples += len(windows)
    return samples


def _count_ending(stats: RenderStats, end: int | None, is_target: list[bool], windows: list) -> None:
    if end is None:
        reason = "source_incomplete"
    elif not is_target[end]:
        reason = "last_turn_unsupervised"
    elif not any(index == end and supervised for window in windows for index, supervised in window):
        reason = "last_turn_overlong"
    else:
        stats.ended += 1
        return
    stats.not_ended[reason] += 1


def rendered_roles(turns: tuple[Turn, ...], user_speaker: str) -> list[list[str]]:
    """The role each turn is rendered as, once per rendering of the conversation (``both``: two renderings).

    Public because evaluation must see a held-out conversation exactly as training does."""
    return [[_role_as_rendered(t.role, user_role) for t in turns] for user_role in _user_roles(turns, user_speaker)]


def _user_roles(turns: tuple[Turn, ...], user_speaker: str) -> list[str]:
    """Which original role plays the user in each rendering of the conversation."""
    if user_speaker == "role":
        return ["user"]
    first = next(t.role for t in turns if t.role != "system")
    second = "assistant" if first == "user" else "user"
    return {"first": [first], "second": [second], "both": [first, second]}[user_speaker]


def _role_as_rendered(role: str, user_role: str) -> str:
    if role == "system":
        return role
    return "user" if role == user_role else "assistant"


def plan_windows(
    plain_lengths: list[int],
    target_lengths: list[int],
    is_target: list[bool],
    seq_length: int,
    pinned_system: bool,
    one_target_per_window: bool,
) -> tuple[list[list[tuple[int, bool]]], int]:
    """Cut a conversation into windows of ``(turn index, supervised)`` that fit ``seq_length``.

    Returns the windows and the number of target turns that alone exceed ``seq_length``.
    """
    targets = [i for i, flag in enumerate(is_target) if flag]
    max_context = seq_length if one_target_per_window else seq_length // 2
    first_free = 1 if pinned_system else 0
    windows = []
    overlong = 0
    position = 0
    while position < len(targets):
        start = targets[position]
        if target_lengths[start] > seq_length:
            overlong += 1
            position += 1
            continue
        budget = min(max_context, seq_length - target_lengths[start])
        keep_system = pinned_system and plain_lengths[0] <= budget
        used = plain_lengths[0] if keep_system else 0
        context_start = start
        while context_start > first_free and used + plain_lengths[context_start - 1] <= budget:
            context_start -= 1
            used += plain_lengths[context_start]
        window = [(0, False)] if keep_system else []
        window += [(i, False) for i in range(context_start, start)]
        window.append((start, True))
        total = used + target_lengths[start]
        position += 1
        if not one_target_per_window:
            extension = []
            for i in range(start + 1, len(is_target)):
                length = target_lengths[i] if is_target[i] else plain_lengths[i]
                if total + length > seq_length or position == len(targets):
                    break
                total += length
                extension.append((i, is_target[i]))
                if is_target[i]:
                    window += extension
                    extension = []
                    position += 1
        windows.append(window)
    return windows, overlong
