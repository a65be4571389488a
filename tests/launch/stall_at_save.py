"""The trainer (``python -m tests.launch.stall_at_save FLAGS``, as ``TRAIN_MODULE`` of the launcher) whose forked
checkpoint writers stall before writing iteration ``$STALL_ITERATION``'s shards, each after writing
``writing-{rank}`` next to the save directory: a fully parallel save in the middle of its write, to kill."""

import os
import sys
import time
from pathlib import Path

from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

from megatron_mimesis.training import train

STALLED = f"iter_{int(os.environ.get('STALL_ITERATION', 0)):07d}.tmp"
_write = FileSystemWriterAsync.write_preloaded_data_multithread


def _stall_then_write(transform_list, use_msc, rank, write_buckets, results_queue):
    shard = Path(write_buckets[0][0])
    if shard.parent.name == STALLED:
        (shard.parent.parent.parent / f"writing-{rank}").write_text(str(os.getpid()))
        time.sleep(600)
    return _write(transform_list, use_msc, rank, write_buckets, results_queue)


if __name__ == "__main__":
    FileSystemWriterAsync.write_preloaded_data_multithread = staticmethod(_stall_then_write)
    sys.exit(train.main(sys.argv[1:]))
