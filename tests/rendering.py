"""data_prep's own rendering of a conversation: the reference that every templated or served rendering of the
same turns must equal, token for token."""

from functools import cache

from data_prep.records import Conversation, Turn
from data_prep.render import ChatTokens, RenderStats, render, texts_to_encode
from data_prep.tokenizer import TextEncoder

SEQ_LENGTH = 1 << 20  # one window: the whole conversation in one sample


@cache
def _encoder(tokenizer_dir) -> TextEncoder:
    return TextEncoder(tokenizer_dir)


def training_samples(turns: list[dict], tokenizer_dir, thinking: bool = False,
                     complete: bool = True) -> list[tuple[list[int], list]]:
    """``(tokens, target spans)`` of ``turns`` (``{"role", "content"[, "thinking"]}`` in the training roles: the
    simulator is ``user``) as ``data_prep.midtrain`` (``thinking=False``) or ``data_prep.sft`` renders them, by default
    as a complete conversation (its last user turn ends with the end marker)."""
    encoder = _encoder(tokenizer_dir)
    conversation = Conversation("c", tuple(Turn(t["role"], t["content"], t.get("thinking")) for t in turns))
    encoded = encoder.encode_batch(texts_to_encode(conversation, thinking, "role", complete))
    return render(conversation, encoded, ChatTokens.from_encoder(encoder), SEQ_LENGTH, "role", thinking,
                  RenderStats(), complete)


def prompt_of_last_turn(turns: list[dict], tokenizer_dir, thinking: bool = False) -> list[int]:
    """The tokens a simulator trained on these rows is given before it writes the last (user) turn of ``turns``:
    everything up to that turn's target, plus the opened think block under thinking."""
    tokens, spans = training_samples(turns, tokenizer_dir, thinking)[-1]
    start = spans[-1][0]
    if not thinking:
        return tokens[:start]
    encoder = _encoder(tokenizer_dir)
    opening = [encoder.special["<think>"], *encoder.encode_batch(["\n"])[0]]
    assert tokens[start:start + len(opening)] == opening, "a thought that starts with whitespace merges the newline"
    return tokens[:start + len(opening)]
