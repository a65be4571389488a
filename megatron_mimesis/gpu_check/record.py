"""What a stage writes: its rows and notes, rewritten atomically after every addition, so a stage stopped at its
cap still reports what it measured."""

import json
import os
from pathlib import Path


def stage_file(out_dir: Path, name: str) -> Path:
    return out_dir / f"stage_{name}.json"


def write_json(path: Path, payload) -> None:
    """Atomically: a reader (or a later stage) never sees half a file."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(payload, indent=1, default=str))
    os.replace(tmp, path)


class StageRecorder:
    """Rows and notes of one stage, written to its file after every addition."""

    def __init__(self, out_dir: Path, name: str):
        self.path, self.data = stage_file(out_dir, name), {"rows": [], "notes": []}

    def row(self, **fields):
        self.data["rows"].append(fields)
        write_json(self.path, self.data)

    def note(self, text: str):
        self.data["notes"].append(text)
        write_json(self.path, self.data)

    def fail(self, error: BaseException):
        """The exception that ended the stage, for the report's status line."""
        self.data["error"] = f"{type(error).__name__}: {error}"[:300]
        write_json(self.path, self.data)
