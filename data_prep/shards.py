"""One shard of records -> rendered samples on disk (runs in the worker processes).

A shard is a fixed run of consecutive records of one corpus, so shard boundaries depend only on the input and
a killed job can skip the shards it already finished. A shard's outputs are plain ``.npy`` arrays per split
(tokens, target mask, sample lengths); ``{stem}.json`` with the shard's counts is written last, by rename, and
is the only sign that the shard is complete. ``data_prep.pipeline`` packs all shards of a corpus into rows.

All contents of a shard are encoded in one ``encode_batch`` call: that is where the time goes, and batching keeps
Python overhead per record small.
"""

import hashlib
import json
import os
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from data_prep.records import Conversation, RecordError, RecordFormat, decode_json_line, to_conversation
from data_prep.render import ChatTokens, RenderStats, render, texts_to_encode
from data_prep.synthetic import with_synthetic_thinking
from data_prep.tokenizer import load_encoder

SPLITS = ("train", "valid")


@dataclass(frozen=True)
class ShardSettings:
    """Everything a worker needs besides the records; identical for all shards of a run."""

    tokenizer: str  # HF tokenizer directory or sentencepiece .model
    tokenizer_sha256: str  # part of the per-process encoder cache key: a path can be retrained in place
    record_format: RecordFormat
    seq_length: int
    user_speaker: str
    with_thinking: bool
    synthetic_thinking: bool
    valid_fraction: float
    skip_bad_records: bool
    token_dtype: str


@dataclass
class ShardResult:
    stem: str
    counts: dict = field(default_factory=dict)
    error: str | None = None


_ENCODERS: dict[tuple[str, str], tuple] = {}


def worker_init() -> None:
    """One tokenizer thread per worker process: the workers are the parallelism."""
    os.environ["TOKENIZERS_PARALLELISM"] = "false"


def split_of(conversation_id: str, valid_fraction: float) -> str:
    """Deterministic split by conversation id, so a conversation (all its samples) never straddles splits."""
    digest = hashlib.blake2b(conversation_id.encode("utf-8"), digest_size=8).digest()
    return "valid" if int.from_bytes(digest, "big") < valid_fraction * 2**64 else "train"


def process_shard(stem: str, records: list[tuple[str, object]], settings: ShardSettings) -> ShardResult:
    """Validate, render and write one shard; with ``skip_bad_records`` off the first bad record aborts it."""
    key = (settings.tokenizer, settings.tokenizer_sha256)
    if key not in _ENCODERS:
        encoder = load_encoder(settings.tokenizer)
        _ENCODERS[key] = (encoder, ChatTokens.from_encoder(encoder))
    encoder, chat = _ENCODERS[key]

    skipped: Counter = Counter()
    conversations: list[Conversation] = []
    for location, raw in records:
        try:
            record = decode_json_line(raw, location) if isinstance(raw, bytes) else raw
            conversation = to_conversation(record, location, settings.record_format)
        except RecordError as err:
            if not settings.skip_bad_records:
                return ShardResult(stem, error=str(err))
            skipped[err.reason] += 1
            continue
        if settings.synthetic_thinking:
            conversation = with_synthetic_thinking(conversation)
        conversations.append(conversation)

    complete = settings.record_format.complete
    texts_per_conversation = [texts_to_encode(c, settings.with_thinking, settings.user_speaker, complete)
                              for c in conversations]
    encoded = encoder.encode_batch([text for texts in texts_per_conversation for text in texts])
    stats = RenderStats()
    samples: dict[str, list] = {split: [] for split in SPLITS}
    position = 0
    for conversation, texts in zip(conversations, texts_per_conversation, strict=True):
        ids = encoded[position : position + len(texts)]
        position += len(texts)
        rendered = render(
            conversation, ids, chat, settings.seq_length, settings.user_speaker, settings.with_thinking, stats, complete
        )
        samples[split_of(conversation.id, settings.valid_fraction)].extend(rendered)

    counts = {
        "documents_in": len(records),
        "conversations": len(conversations),
        "content_tokens": sum(len(ids) for ids in encoded),
        "skipped": dict(skipped),
        "dropped": {"no_target_turn": stats.no_target_turn, "overlong_target_turns": stats.overlong_target_turns},
        "end_targets": {"ended": stats.ended, **stats.not_ended},
    }
    for split in SPLITS:
        counts[split] = write_split(stem, split, samples[split], np.dtype(settings.token_dtype))
    tmp = f"{stem}.json.tmp"
    Path(tmp).write_text(json.dumps(counts))
    os.replace(tmp, f"{stem}.json")
    return ShardResult(stem, counts)


def write_split(stem: str, split: str, samples: list[tuple[list[int], list[tuple[int, int, int]]]], dtype) -> dict:
    lengths = np.array([len(tokens) for tokens, _ in samples], dtype=np.int64)
    offsets = np.cumsum(lengths) - lengths
    tokens = np.concatenate([np.array(t, dtype=dtype) for t, _ in samples]) if samples else np.zeros(0, dtype)
    starts = [
        offset + start for offset, (_, spans) in zip(offsets.tolist(), samples, strict=True) for start, _, _ in spans
    ]
    ends = [offset + end for offset, (_, spans) in zip(offsets.tolist(), samples, strict=True) for _, end, _ in spans]
    edges = np.zeros(len(tokens) + 1, dtype=np.int8)  # +1 where a target span opens, -1 where it closes
    edges[starts] += 1
    edges[ends] -= 1
    mask = np.cumsum(edges[:-1], dtype=np.int8).astype(np.uint8)
    np.save(f"{stem}.{split}.lengths.npy", lengths)
    np.save(f"{stem}.{split}.tokens.npy", tokens)
    np.save(f"{stem}.{split}.mask.npy", mask)
    return {"samples": len(samples), "tokens": int(lengths.sum()), "loss_tokens": int(mask.sum(dtype=np.int64))}


def load_split(stem: str, split: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A finished shard's (lengths, tokens, mask) for one split, memory-mapped."""
    return tuple(np.load(f"{stem}.{split}.{part}.npy", mmap_mode="r") for part in ("lengths", "tokens", "mask"))
