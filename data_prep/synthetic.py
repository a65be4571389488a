"""Deterministic stand-in "thinking" for the SFT demo.

The embedded chit-chat corpus has no private thoughts, but the SFT path must be exercised end to end. Each turn
gets a short templated thought built from the previous turn; the manifest marks such datasets as synthetic so
nobody mistakes them for ThoughtTrace data.
"""

from dataclasses import replace

from data_prep.records import Conversation

DESCRIPTION = "synthetic: templated from the previous turn by data_prep.synthetic, not real thoughts"
QUOTED_WORDS = 8


def with_synthetic_thinking(conversation: Conversation) -> Conversation:
    turns = []
    previous = None
    for turn in conversation.turns:
        if turn.role == "system":
            turns.append(turn)
            continue
        if previous is None:
            thought = "I am opening the conversation, so I start with something simple."
        else:
            words = previous.split()
            quote = " ".join(words[:QUOTED_WORDS]) + (" ..." if len(words) > QUOTED_WORDS else "")
            thought = f'They said "{quote}". I answer that in my own words and keep it short.'
        turns.append(replace(turn, thinking=thought))
        previous = turn.content
    return replace(conversation, turns=tuple(turns))
