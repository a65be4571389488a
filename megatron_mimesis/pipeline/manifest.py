"""A stage's record of what it produced and from which inputs (``RUN_DIR/NAME/stage.json``), written atomically.

The record is what makes a pipeline idempotent and resumable: a stage whose record says ``done`` with the
fingerprint its inputs have now is skipped; one that was interrupted or failed runs again, and its launcher resumes
it from the checkpoint in its save directory; one whose record holds another fingerprint is refused
(``resolve.resolve``).
"""

import json
import os
import time
from pathlib import Path

NAME = "stage.json"


def read(directory: Path) -> dict | None:
    path = directory / NAME
    if not path.is_file():
        return None
    try:
        record = json.loads(path.read_text())
    except json.JSONDecodeError:
        return None  # a record cut by a crash of the machine: the stage runs again
    return record if isinstance(record, dict) else None


def write(directory: Path, record: dict) -> dict:
    directory.mkdir(parents=True, exist_ok=True)
    record = {**record, "updated_at": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    tmp = directory / f".{NAME}.{os.getpid()}.tmp"
    tmp.write_text(json.dumps(record, indent=2, default=str) + "\n")
    os.replace(tmp, directory / NAME)
    return record
