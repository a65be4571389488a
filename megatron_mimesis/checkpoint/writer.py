"""Writing a dist checkpoint so that a reader never sees half of one: the write itself (megatron-core's
``dist_checkpointing.save``) and the publication of the finished directory under its iteration and ``latest``.

Each checkpoint is written to ``iter_0000100.tmp``, listed in ``files.json`` when every rank has finished
(``integrity.record_files``), and renamed; ``latest`` is replaced last (write + rename). A re-save of an existing
iteration (a finished job rerun or requeued) moves the old directory aside to ``iter_0000100.old`` rather than
deleting it, and readers take ``.old`` while ``iter_N`` is absent. The trainer's saves (``trainer_state.py``) and
the HF import (``conversion.py``) both write through here.

No helper process. megatron-core's torch_dist writer hands its results over a queue that it creates, at the first
save, as ``multiprocessing.get_context("spawn").Manager().Queue()``: a spawned interpreter per rank (about 1 GB:
it re-imports the trainer) that nothing ties to the rank, so it outlives a ``kill -9`` of the job. That queue only
matters for megatron's asynchronous saves, whose writer runs in another process. This project saves
synchronously: megatron runs the writer (and its threads) in the calling process, so :func:`dist_save` gives each
save an in-process ``queue.Queue`` through megatron's own slot for it; nothing is started, nothing can be left
behind, and a save no longer needs ``/dev/shm`` or a writable temp directory for a Manager socket.
"""

import os
import queue
import shutil
from pathlib import Path

from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.strategies import filesystem_async

from megatron_mimesis.checkpoint.reader import LATEST, OLD_SUFFIX, checkpoint_dir


def dist_save(state: dict, directory: str | Path) -> None:
    """``dist_checkpointing.save`` with megatron's results queue in this process (see the module docstring)."""
    filesystem_async._results_queue = queue.Queue()
    dist_checkpointing.save(state, str(directory))


def publish(tmp: Path, root: Path, iteration: int) -> None:
    """Make the complete ``tmp`` the checkpoint of ``iteration`` and point ``latest`` at it.

    Every step is one rename, and at each point between them iteration N is readable: ``iter_N``, or ``iter_N.old``
    (the previous save of N, moved aside rather than deleted) while ``iter_N`` is absent.
    """
    final = checkpoint_dir(root, iteration)
    old = final.with_name(final.name + OLD_SUFFIX)
    if old.exists() and not final.exists():  # a re-save killed between its two renames: restore the old one
        os.replace(old, final)
    shutil.rmtree(old, ignore_errors=True)
    if final.exists():
        os.replace(final, old)
    os.replace(tmp, final)
    latest_tmp = root / (LATEST + ".tmp")
    latest_tmp.write_text(f"{iteration}\n")
    os.replace(latest_tmp, root / LATEST)
    shutil.rmtree(old, ignore_errors=True)
