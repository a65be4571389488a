"""Which checkpoints a run keeps: the newest ``keep_last_n`` and, for evaluation, every one whose iteration is a
multiple of ``keep_every``; the rest are deleted, and only once a newer checkpoint is published and verified.

One rule, :func:`deletable`, serves both the run (``trainer_state.CheckpointSaver`` applies it after each
publication) and the plan (:func:`most_on_disk`, what the save directory must hold at most, which the memory plan prints
and the start-up space check asks for). Without ``keep_last_n`` every checkpoint is kept.

A deleted checkpoint is first renamed out of the ``iter_N`` namespace (``iter_N.deleting``), so no reader sees half
of one, then removed; a ``.deleting`` left by a kill is removed at the next deletion.
"""

import os
import shutil
from collections.abc import Iterable
from pathlib import Path

DELETING_SUFFIX = ".deleting"


def deletable(iterations: Iterable[int], published: int, keep_last_n: int | None,
              keep_every: int | None) -> list[int]:
    """Of the complete checkpoints ``iterations``, those to delete once ``published`` is published and verified:
    every one older than it except the newest ``keep_last_n - 1`` and the multiples of ``keep_every``, newest first.
    Newer ones (left by a run this one overwrote) are not this rule's to delete."""
    if keep_last_n is None:
        return []
    older = sorted((i for i in set(iterations) if i < published), reverse=True)
    return [i for i in older[keep_last_n - 1:] if not (keep_every and i % keep_every == 0)]


def most_on_disk(saves: list[int], keep_last_n: int | None, keep_every: int | None) -> int:
    """The most checkpoints on disk at once for a run that saves at ``saves``: each new one is written and published
    before the ones it supersedes are deleted."""
    kept: set[int] = set()
    most = 0
    for iteration in sorted(saves):
        kept.add(iteration)
        most = max(most, len(kept))
        kept -= set(deletable(kept, iteration, keep_last_n, keep_every))
    return most


def delete(directory: Path) -> None:
    """Remove a checkpoint directory: renamed away from its ``iter_N`` name first, then removed."""
    doomed = directory.with_name(directory.name + DELETING_SUFFIX)
    os.replace(directory, doomed)
    shutil.rmtree(doomed)


def remove_leftovers(root: Path) -> None:
    """The ``.deleting`` directories of deletions a kill interrupted."""
    for leftover in root.glob(f"iter_*{DELETING_SUFFIX}"):
        shutil.rmtree(leftover, ignore_errors=True)
