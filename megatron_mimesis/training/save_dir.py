"""Whether a run's save directory can take its checkpoints, checked once a job before any rank does work.

At the start of a run, not at its first save: ``save`` must be a writable directory (or creatable in one) with room
for the checkpoints the run keeps at once (every one it saves without ``keep_last_n``; with it, the newest N, those
``keep_every`` keeps, and the next one before an older one is deleted), less what its checkpoints already there take;
so the hours before a save are not lost to a typo, a full disk or a quota. A checkpoint's size is the memory plan's:
the launchers check it in their pre-launch ``--dry-run --check-save-dir``, where the plan is made anyway, and tell the
ranks (``SAVE_DIR_CHECKED``); a rank started without them (a bare torchrun) has rank 0 check, before the process
group starts. Not part of a plain ``--dry-run``: the paper's config planned on a laptop has no room for its
checkpoints.
"""

import os
import shutil
from pathlib import Path

from megatron_mimesis.training.config import ConfigError

SAVE_DIR_CHECKED = "MIMESIS_SAVE_DIR_CHECKED"  # set to 1 by a launcher whose pre-check passed


def check_save_dir(config, world_size: int, checkpoint_bytes: int | None = None) -> None:
    """Raise ConfigError with the one-line reason when ``config.save`` cannot take the run's checkpoints;
    ``checkpoint_bytes``: one checkpoint's size when a plan already has it (else planned here)."""
    if not config.save:
        return
    from megatron_mimesis.checkpoint.retention import most_on_disk
    from megatron_mimesis.training.memory.checkpoint import readable_bytes
    from megatron_mimesis.training.memory.plan import planned_checkpoint_bytes

    path = Path(config.save).absolute()
    existing = next(p for p in (path, *path.parents) if p.exists())
    if not existing.is_dir():
        raise ConfigError(f"save: {existing} is not a directory")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(f"save: {existing} is not writable")
    size = checkpoint_bytes if checkpoint_bytes is not None else planned_checkpoint_bytes(config, world_size)
    count = most_on_disk(config.planned_saves(), config.keep_last_n, config.keep_every)
    held = sum(f.stat().st_size for f in path.glob("iter_*/**/*") if f.is_file()) if path.is_dir() else 0
    free, needed = shutil.disk_usage(existing).free, max(size, count * size - held)
    if free < needed:
        fewer = "" if config.keep_last_n or count == 1 else ": keep fewer with keep_last_n"
        raise ConfigError(f"save: no space left for the checkpoints of this run in {existing}: {readable_bytes(free)} "
                          f"free, {readable_bytes(needed)} needed ({count} checkpoint{'s' * (count > 1)} of about "
                          f"{readable_bytes(size)} on disk at once){fewer}")


def needs_check_here() -> bool:
    """Whether this process checks: no launcher checked for the job, and it is rank 0 (or no rank of a job)."""
    return os.environ.get(SAVE_DIR_CHECKED) != "1" and os.environ.get("RANK", "0") == "0"
