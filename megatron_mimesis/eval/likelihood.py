"""Teacher-forced likelihood of the real human turns: the simulator's validation loss, per turn.

Each held-out rendering is cut into samples by ``data_prep.render.render`` with the simulator's own tokenizer, so
the scored tokens are exactly the mid-training targets (a user turn's content and its ``<|im_end|>``, the end
marker on the human's last turn of a complete conversation, the context windowed as in training) and the token-weighted mean over a set of conversations is the trainer's
validation loss on their rows. Bits per UTF-8 byte divide the same nats by ln 2 and by the bytes of the human's
text: unlike NLL per token it does not depend on how finely a tokenizer cuts the text, so simulators with
different tokenizers compare on it.
"""

import math
from dataclasses import dataclass

from data_prep.records import Conversation, Turn
from data_prep.render import ChatTokens, RenderStats, end_turns, render, texts_to_encode, with_end_marker
from data_prep.tokenizer import load_encoder


class LikelihoodUnavailable(RuntimeError):
    """The simulator cannot score given text (e.g. an endpoint without prompt log-probs); the reason is reported."""


@dataclass(frozen=True)
class TurnNLL:
    key: str  # the Position key
    nll: float  # nats, summed over the turn's target tokens (its content and <|im_end|>)
    tokens: int
    bytes: int  # UTF-8 bytes of the human's text


def score_renderings(scorer, tokenizer_dir: str, renderings, seq_length: int) -> tuple[list[TurnNLL], int]:
    """NLL of every human turn that fits ``seq_length``, and the count of those that do not (data_prep drops the
    same ones from training as ``overlong_target_turns``). In complete conversations the human's last turn
    is scored with the end marker training puts there (its bytes count with it).

    ``scorer(samples, targets)`` returns, per sample (a token list), the log-prob of ``sample[t]`` given
    ``sample[:t]`` for each ``t`` in its targets."""
    encoder = load_encoder(tokenizer_dir)
    chat = ChatTokens.from_encoder(encoder)
    samples, targets, owners = [], [], []
    overlong = 0
    for one in renderings:
        conversation, unit, complete = one.conversation, one.unit, one.complete
        rendering = as_rendered(conversation, one.roles)
        encoded = encoder.encode_batch(texts_to_encode(rendering, False, "role", complete))
        stats = RenderStats()
        rendered = render(rendering, encoded, chat, seq_length, "role", False, stats, complete)
        overlong += stats.overlong_target_turns
        (end,) = end_turns(rendering.turns, "role", complete)
        for tokens, spans in rendered:
            samples.append(tokens)
            targets.append([t for start, stop, _ in spans for t in range(start, stop)])
            owners.append((conversation, unit, end, [(turn, stop - start) for start, stop, turn in spans]))
    logprobs = scorer(samples, targets)
    turns = []
    for (conversation, unit, end, sample_owners), sample_logprobs in zip(owners, logprobs, strict=True):
        offset = 0
        for turn, length in sample_owners:
            nll = -math.fsum(sample_logprobs[offset:offset + length])
            offset += length
            text = conversation.turns[turn].content
            text = with_end_marker(text) if turn == end else text
            turns.append(TurnNLL(f"{unit}/{turn}", nll, length, len(text.encode("utf-8"))))
    return turns, overlong


def as_rendered(conversation: Conversation, roles: list[str]) -> Conversation:
    """One rendering as a conversation of its own (roles as rendered), so ``render`` with ``"role"`` yields its
    samples alone, in order."""
    turns = tuple(Turn(role, turn.content) for role, turn in zip(roles, conversation.turns, strict=True))
    return Conversation(conversation.id, turns)
