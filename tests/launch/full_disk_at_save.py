"""The trainer (``python -m tests.launch.full_disk_at_save FLAGS``, as ``TRAIN_MODULE`` of the launcher) on a save
disk that fills after its first checkpoint: every shard file of a later checkpoint is written to ``/dev/full``, so
the kernel answers each write with ENOSPC, as a full disk does, in the writer megatron-core forks."""

import builtins
import sys

from megatron.core.dist_checkpointing.strategies import filesystem_async

from megatron_mimesis.training import train

FIRST_SAVE = "iter_0000001.tmp"


def _open_on_a_full_disk_after_the_first_save(name, mode="r", *args, **kwargs):
    if "w" in mode and FIRST_SAVE not in str(name):
        name = "/dev/full"
    return builtins.open(name, mode, *args, **kwargs)


if __name__ == "__main__":
    filesystem_async.open = _open_on_a_full_disk_after_the_first_save  # the module's writes look `open` up here
    sys.exit(train.main(sys.argv[1:]))
