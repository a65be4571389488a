"""Input corpora as streams of ``(location, raw record)``, never loaded whole (except the embedded corpus).

* ``*.jsonl`` / ``*.json`` (one JSON object per line): raw lines as bytes, parsed in the worker processes so
  the reading process stays cheap; location ``file:line``.
* ``*.parquet``: rows as dicts, read one record batch at a time; location ``file:row N``.
* anything else: a Hugging Face ``datasets`` name or local dataset directory, loaded with ``streaming=True``
  and the given split; location ``name:row N``.
* the embedded chit-chat corpus (``chitchat_dataset``'s dataset.json, 40 MB, read with ``json.load`` since it is
  a single JSON object).

Each source also reports its fingerprint (size and SHA-256 of the file(s)) for the manifest and the cache key.
"""

import hashlib
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pyarrow.parquet as pq

JSONL_SUFFIXES = (".jsonl", ".json")
PARQUET_SUFFIXES = (".parquet",)


@dataclass(frozen=True)
class Source:
    """One corpus: where it is and how to stream it."""

    name: str
    path: str
    kind: str  # "jsonl" | "parquet" | "datasets" | "chitchat"
    split: str = "train"

    def records(self) -> Iterator[tuple[str, object]]:
        if self.kind == "jsonl":
            with open(self.path, "rb") as handle:
                for number, line in enumerate(handle, start=1):
                    if line.strip():
                        yield f"{self.path}:{number}", line
        elif self.kind == "parquet":
            row = 0
            for batch in pq.ParquetFile(self.path).iter_batches(batch_size=1024):
                for record in batch.to_pylist():
                    yield f"{self.path}:row {row}", record
                    row += 1
        elif self.kind == "chitchat":
            with open(self.path, "rb") as handle:
                corpus = json.load(handle)
            for key, conversation in corpus.items():
                yield f"{self.path}:{key}", {"id": key, "messages": conversation["messages"]}
        else:
            import datasets

            for row, record in enumerate(datasets.load_dataset(self.path, split=self.split, streaming=True)):
                yield f"{self.path}:row {row}", record

    def fingerprint(self) -> dict:
        """Size and SHA-256 of the input file(s); a hub dataset is identified by name and split only."""
        path = Path(self.path)
        if not path.exists():
            return {"path": self.path, "kind": self.kind, "split": self.split}
        files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
        digest = hashlib.sha256()
        size = 0
        for file in files:
            with open(file, "rb") as handle:
                while chunk := handle.read(1 << 22):
                    digest.update(chunk)
                    size += len(chunk)
        return {"path": str(path.resolve()), "kind": self.kind, "bytes": size, "sha256": digest.hexdigest()}


def open_source(spec: str, split: str) -> Source:
    """Pick the reader by file suffix; everything that is not a JSONL/Parquet file goes to ``datasets``."""
    path = Path(spec)
    if path.suffix in JSONL_SUFFIXES or path.suffix in PARQUET_SUFFIXES:
        if not path.is_file():
            raise FileNotFoundError(f"{spec}: no such file")
        kind = "jsonl" if path.suffix in JSONL_SUFFIXES else "parquet"
        return Source(_corpus_name(path.stem), spec, kind)
    return Source(_corpus_name(path.name or spec), spec, "datasets", split)


def chitchat_source() -> Source:
    """The embedded default corpus: ~7k human-human chats from the MIT-licensed ``chitchat-dataset`` wheel."""
    import chitchat_dataset

    return Source("chitchat", str(Path(chitchat_dataset.__file__).with_name("dataset.json")), "chitchat")


def _corpus_name(stem: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", stem).strip("_") or "corpus"
