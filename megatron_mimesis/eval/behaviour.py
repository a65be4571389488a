"""What a turn looks like, measured without any model: the features behind the LLM-free behaviour statistics.

Each feature is a property a reader notices when a simulator does not sound like a person: how long it talks,
whether it asks, whether it ends the conversation, how varied its words are, how much it parrots the other
side's last turn, and whether it writes like an assistant (markdown structure, service openers, sign-offs).
"""

import re

COPY_N = 2  # word n-grams for copying: chit-chat turns are short, a bigram already says "repeated a phrase"
_WORD = re.compile(r"\w+(?:'\w+)?")
_ASSISTANT_MARKERS = re.compile(
    r"(?im)"
    r"^\s*(?:[-*\u2022]|\d+[.)])\s+\S"  # a markdown list item
    r"|^\s*#{1,6}\s+\S"  # a markdown header
    r"|\*\*[^*\n]+\*\*"  # bold
    r"|^\W*(?:certainly|absolutely|of course|sure thing|great question|i'?d be (?:happy|glad) to|i'?m happy to"
    r"|as an ai)\b"  # service openers
    r"|\b(?:let me know if|hope (?:this|that) helps|feel free to|is there anything else|happy to help"
    r"|i'?m here to help)\b"  # sign-offs and offers
)


def words(text: str) -> list[str]:
    """Lower-cased word tokens (letters, digits, inner apostrophes): the unit of length and diversity."""
    return _WORD.findall(text.lower())


def ngrams(tokens: list[str], n: int) -> list[tuple[str, ...]]:
    return [tuple(tokens[i:i + n]) for i in range(len(tokens) - n + 1)]


def features(text: str, last_assistant: str) -> dict:
    """Per-turn features; ``copy`` is None where there is nothing to copy from or no n-gram to compare."""
    tokens = words(text)
    grams = ngrams(tokens, COPY_N)
    source = set(ngrams(words(last_assistant), COPY_N))
    return {
        "words": len(tokens),
        "question": "?" in text,
        "copy": sum(g in source for g in grams) / len(grams) if grams and source else None,
        "assistant_like": bool(_ASSISTANT_MARKERS.search(text)),
        "unigrams": tokens,
        "bigrams": [" ".join(g) for g in ngrams(tokens, 2)],
    }
