"""Shared fixtures: a character-level tokenizer whose ids can be written down by hand.

Ids: 0 <|endoftext|>, 1 <|im_start|>, 2 <|im_end|>, 3 <think>, 4 </think>, 5 "\\n", 6 " ", then a..z = 7..32,
then the characters of ``PUNCTUATION`` from 33 on, then E, N, D (the end marker's letters). BPE without merges and without a pre-tokenizer encodes every
character as its own token, so ``ids("hi") == [14, 15]``.
"""

import json
import string
from pathlib import Path

import pytest
from tokenizers import AddedToken, Tokenizer, models

from data_prep.tokenizer import SPECIAL_TOKENS, TextEncoder

PUNCTUATION = "?.,!'<>|/_"
CHARS = "\n " + string.ascii_lowercase + PUNCTUATION + "END"
VOCAB = {token: i for i, token in enumerate([*SPECIAL_TOKENS, *CHARS])}
EOT, IM_START, IM_END, THINK, END_THINK, NL = 0, 1, 2, 3, 4, 5


def ids(text: str) -> list[int]:
    return [VOCAB[c] for c in text]


@pytest.fixture(scope="session")
def char_tokenizer_dir(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("char_tokenizer")
    tokenizer = Tokenizer(models.BPE(vocab=VOCAB, merges=[]))
    tokenizer.add_special_tokens([AddedToken(t, special=True) for t in SPECIAL_TOKENS])
    tokenizer.save(str(directory / "tokenizer.json"))
    return directory


@pytest.fixture(scope="session")
def encoder(char_tokenizer_dir) -> TextEncoder:
    return TextEncoder(char_tokenizer_dir)


def write_jsonl(path: Path, records: list) -> Path:
    with open(path, "wb") as handle:
        for record in records:
            line = record if isinstance(record, bytes) else json.dumps(record).encode()
            handle.write(line + b"\n")
    return path


def conversation(*turns: tuple[str, str] | tuple[str, str, str], conversation_id: str | None = None) -> dict:
    messages = []
    for turn in turns:
        message = {"role": turn[0], "content": turn[1]}
        if len(turn) == 3:
            message["thinking"] = turn[2]
        messages.append(message)
    return {"messages": messages} if conversation_id is None else {"id": conversation_id, "messages": messages}
