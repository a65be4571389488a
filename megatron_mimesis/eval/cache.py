"""An append-only JSONL record of every finished expensive call, so that a killed evaluation resumes.

Each generation and each judge verdict is appended (and flushed) the moment it exists, keyed by a hash of
everything that determines it (the request, the simulator's spec and settings, the seed). A resumed run reads
the file back and asks only for what is missing; entries of other settings simply never match. A process killed
mid-write leaves at most a torn last line, which is counted and ignored. Values are plain JSON: reading the
cache never runs anything.
"""

import hashlib
import json
import threading
from pathlib import Path

CACHE = "cache.jsonl"  # its name in an evaluation's --output


def cache_key(*parts) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, ensure_ascii=False).encode()).hexdigest()


class ResultCache:
    def __init__(self, path: Path):
        self.path = path
        self.entries: dict[str, object] = {}
        self.torn_lines = 0
        if path.exists():
            for line in path.read_text(encoding="utf-8").splitlines():
                try:
                    entry = json.loads(line)
                    self.entries[entry["key"]] = entry["value"]
                except (json.JSONDecodeError, KeyError, TypeError):
                    self.torn_lines += 1
        self.reused = len(self.entries)
        self._file = path.open("a", encoding="utf-8")
        self._lock = threading.Lock()

    def get(self, key: str):
        return self.entries.get(key)

    def __contains__(self, key: str) -> bool:
        return key in self.entries

    def put(self, key: str, value) -> None:
        with self._lock:
            self.entries[key] = value
            self._file.write(json.dumps({"key": key, "value": value}, ensure_ascii=False) + "\n")
            self._file.flush()

    def close(self) -> None:
        self._file.close()
