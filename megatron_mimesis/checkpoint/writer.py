"""Writing a dist checkpoint so that a reader never sees half of one: the write itself (megatron-core's
``dist_checkpointing.save``) and the publication of the finished directory under its iteration and ``latest``.

Each checkpoint is written to ``iter_0000100.tmp``, listed in ``files.json`` when every rank has finished
(``integrity.record_files``), and renamed; ``latest`` is replaced last (write + rename). A re-save of an existing
iteration (a finished job rerun or requeued) moves the old directory aside to ``iter_0000100.old`` rather than
deleting it, and readers take ``.old`` while ``iter_N`` is absent. The trainer's saves (``trainer_state.py``) and
the HF import (``hf_import.py``) both write through here.

*Streamed saves.* :func:`dist_save_streamed` writes the same format for a model whose weights are not in memory
(the HF import): megatron-core builds the sharded state dict of a model on the meta device, so every key, global
shape, chunk and object is megatron's own, and torch DCP asks for each chunk's data only when it writes that chunk
(``SavePlanner.resolve_data``). torch's ``FileSystemWriter`` keeps every tensor of a file alive until the file is
closed, so the streamed save writes one file per chunk: peak memory is one chunk and its source, whatever the size
of the model.

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
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing import ShardedObject
from megatron.core.dist_checkpointing.core import CheckpointingConfig, save_config
from megatron.core.dist_checkpointing.state_dict_utils import save_preprocess
from megatron.core.dist_checkpointing.strategies import filesystem_async
from megatron.core.dist_checkpointing.strategies.torch import (
    MCoreSavePlanner,
    TorchDistSaveShardedStrategy,
    _replace_state_dict_keys_with_sharded_keys,
    mcore_to_pyt_state_dict,
)
from torch.distributed.checkpoint.planner import WriteItem, WriteItemType
from tqdm import tqdm

from megatron_mimesis.checkpoint.reader import LATEST, OLD_SUFFIX, checkpoint_dir


def dist_save(state: dict, directory: str | Path) -> None:
    """``dist_checkpointing.save`` with megatron's results queue in this process (see the module docstring)."""
    filesystem_async._results_queue = queue.Queue()
    dist_checkpointing.save(state, str(directory))


class _ResolvingPlanner(MCoreSavePlanner):
    """megatron's save planner, with each tensor chunk's data taken from ``resolve(key)`` (the global tensor) when
    DCP writes it, instead of from the state dict (whose tensors are on the meta device)."""

    def __init__(self, resolve: Callable[[str], torch.Tensor], progress: bool):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self._resolve = resolve
        self._progress = progress
        self.bar = None

    def create_local_plan(self):
        plan = super().create_local_plan()
        chunks = sum(item.type != WriteItemType.BYTE_IO for item in plan.items)
        self.bar = tqdm(total=chunks, desc="write", unit="tensor", disable=not self._progress)
        return plan

    def resolve_data(self, write_item: WriteItem):
        if write_item.type == WriteItemType.BYTE_IO:
            return super().resolve_data(write_item)
        self.bar.update()
        key, data = write_item.index.fqn, write_item.tensor_data
        full = self._resolve(key)
        if full.shape != data.size:
            raise ValueError(f"{key}: the source tensor has shape {tuple(full.shape)}, the model's is "
                             f"{tuple(data.size)}")
        chunk = full
        for dim, (offset, size) in enumerate(zip(data.chunk.offsets, data.chunk.sizes, strict=True)):
            chunk = chunk.narrow(dim, offset, size)
        return chunk.to(data.properties.dtype).contiguous()


def dist_save_streamed(sharded_state_dict: dict, directory: str | Path, resolve: Callable[[str], torch.Tensor],
                       progress: bool = True) -> None:
    """What :func:`dist_save` writes for ``sharded_state_dict``, with the tensors' data from ``resolve(key)``.

    ``sharded_state_dict`` is that of a model on the meta device in a world of one process (only its structure is
    read); ``resolve`` returns the global tensor stored under a checkpoint key, e.g. ``decoder.layers.3.mlp.linear_fc2
    .weight``. The common state and ``metadata.json`` are written as megatron-core's ``save`` writes them.
    """
    if dist.get_world_size() != 1:
        raise RuntimeError("dist_save_streamed writes every chunk itself: call it in a world of one process")
    sharded, common = save_preprocess(sharded_state_dict, validate_access_integrity=False)
    sharded["common_state"] = ShardedObject(key="common_state", data=common, global_shape=(1,), global_offset=(0,),
                                            replica_id=0)
    by_key, _, _ = _replace_state_dict_keys_with_sharded_keys(sharded, keep_only_main_replica=True)
    planner = _ResolvingPlanner(resolve, progress)
    dcp.save(mcore_to_pyt_state_dict(by_key, is_loading=False),
             storage_writer=dcp.FileSystemWriter(str(directory), single_file_per_rank=False), planner=planner)
    planner.bar.close()
    strategy = TorchDistSaveShardedStrategy()
    save_config(CheckpointingConfig(strategy.backend, strategy.version), str(directory))


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
