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

*Synchronous and asynchronous saves* are one request (megatron-core's ``AsyncRequest``, from its torch_dist
strategy): :func:`save_request` returns it, ``execute_sync()`` runs it in the calling process, megatron's
``AsyncCallsQueue`` runs it in a forked writer (``trainer_state.CheckpointSaver`` chooses). megatron's two ways of
running a request in the background are a persistent worker, which is *spawned* (a second interpreter per rank that
re-imports the trainer, ~1 GB) and hands its results over a queue of a spawned ``Manager`` process, and a writer
*forked* per save. The forked one is used: the tensors are already in host memory when it starts (megatron copies
them before the fork), it needs no re-import, and :func:`save_request` ties it to the rank
(:func:`megatron_mimesis.lifetime.die_with_parent`), so a ``kill -9`` of the rank takes the writer with it. Nor is
megatron's ``Manager`` queue used by either: that spawned process outlived a ``kill -9`` of the job, so the results
come back over an in-process queue (synchronous) or a pipe that a parent thread drains as the child writes it
(forked; a pipe read only once the writer exited would block a writer whose results exceed the pipe's buffer).

*The errors of a failed write.* megatron-core's writer turns a failed shard write into "An error is caught while
starting worker 0, error: <class 'OSError'>": the errno is gone. :func:`_keep_write_failures` records each failed
write's exception as it happens, and the results queue hands that exception over instead of megatron's, so a full
disk reads "No space left on device" where the save is reported; megatron's two log lines of the same failure are
hidden.
"""

import logging
import multiprocessing
import os
import queue
import shutil
import threading
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing import ShardedObject
from megatron.core.dist_checkpointing.core import CheckpointingConfig, save_config
from megatron.core.dist_checkpointing.state_dict_utils import save_preprocess
from megatron.core.dist_checkpointing.strategies import filesystem_async
from megatron.core.dist_checkpointing.strategies.async_utils import AsyncRequest
from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync
from megatron.core.dist_checkpointing.strategies.fully_parallel import FullyParallelSaveStrategyWrapper
from megatron.core.dist_checkpointing.strategies.torch import (
    MCoreSavePlanner,
    TorchDistSaveShardedStrategy,
    _replace_state_dict_keys_with_sharded_keys,
    mcore_to_pyt_state_dict,
)
from torch.distributed.checkpoint.planner import WriteItem, WriteItemType
from tqdm import tqdm

from megatron_mimesis.checkpoint.reader import LATEST, OLD_SUFFIX, checkpoint_dir
from megatron_mimesis.lifetime import die_with_parent

_write_failures: list[BaseException] = []  # this process's failed shard writes, until the results are handed over
_WRITER_GRACE_S = 5.0  # how long a finished writer's results may still be in flight in the pipe


def _keep_write_failures(write):
    def write_keeping_failures(*args, **kwargs):
        output = write(*args, **kwargs)
        if output is not None and isinstance(output[1], BaseException):
            _write_failures.append(output[1])
        return output

    write_keeping_failures.keeps_failures = True
    return write_keeping_failures


if not getattr(FileSystemWriterAsync.write_preloaded_data, "keeps_failures", False):
    FileSystemWriterAsync.write_preloaded_data = staticmethod(_keep_write_failures(FileSystemWriterAsync.write_preloaded_data))
    logging.getLogger(filesystem_async.__name__).addFilter(
        lambda record: not record.getMessage().startswith(("Local worker", "An error is caught while starting worker")))


class _WriteResults:
    """megatron's results queue for one save: ``put`` by the writer, ``get_nowait`` by the finalization."""

    def __init__(self):
        self._received = queue.Queue()

    def put(self, item) -> None:
        if isinstance(item, Exception) and _write_failures:
            item = _write_failures[0]  # the failed write itself, not megatron's summary of it
        _write_failures.clear()
        self._deliver(item)

    def _deliver(self, item) -> None:
        self._received.put(item)

    def get_nowait(self):
        return self._received.get_nowait()


class _ForkedWriteResults(_WriteResults):
    """The results of a forked writer: it sends them down a pipe, which a thread of the rank drains at once."""

    def __init__(self):
        super().__init__()
        self._pipe = multiprocessing.get_context("fork").SimpleQueue()
        self._drain = threading.Thread(target=lambda: self._received.put(self._pipe.get()), daemon=True)

    def start(self) -> None:
        self._drain.start()

    def _deliver(self, item) -> None:
        self._pipe.put(item)

    def get_nowait(self):
        self._drain.join(timeout=_WRITER_GRACE_S)  # the writer has exited: what it sent is in the pipe
        return super().get_nowait()


def _tied_to(parent_pid: int, write, *args, **kwargs) -> None:
    die_with_parent(parent_pid)
    write(*args, **kwargs)


def save_request(state: dict, directory: str | Path, *, forked: bool,
                 parallel_group: dist.ProcessGroup | None = None) -> AsyncRequest:
    """megatron-core's save of ``state`` into ``directory`` as a request to run: ``execute_sync()`` here, or on an
    ``AsyncCallsQueue``, in a writer forked from this rank (``forked``) that dies with it.

    With ``parallel_group`` (the data-parallel group) the save is megatron's fully parallel one
    (``FullyParallelSaveStrategyWrapper``, Megatron-LM's ``--ckpt-fully-parallel-save``): the tensors every rank of
    the group holds, the weights, are split between them by size, so each rank writes its share instead of the
    group's first rank writing them all; what only one rank holds (its optimizer shard) it writes itself."""
    results = _ForkedWriteResults() if forked else _WriteResults()
    filesystem_async._results_queue = results
    strategy = None if parallel_group is None else FullyParallelSaveStrategyWrapper(TorchDistSaveShardedStrategy(),
                                                                                      parallel_group)
    request = dist_checkpointing.save(state, str(directory), sharded_strategy=strategy, async_sharded_save=True,
                                      async_strategy="mcore")
    if forked and request.async_fn is not None:  # None: nothing of the checkpoint is this rank's to write
        results.start()
        request = request._replace(async_fn=partial(_tied_to, os.getpid(), request.async_fn))
    return request


def dist_save(state: dict, directory: str | Path) -> None:
    """``dist_checkpointing.save`` of ``state``, in this process (see the module docstring)."""
    save_request(state, directory, forked=False).execute_sync()


class _ResolvingPlanner(MCoreSavePlanner):
    """megatron's save planner, with each tensor chunk's data taken from ``resolve(key, offsets, sizes)`` when DCP
    writes it, instead of from the state dict (whose tensors are on the meta device)."""

    def __init__(self, resolve: Callable[..., torch.Tensor], progress: bool):
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
        chunk = self._resolve(key, tuple(data.chunk.offsets), tuple(data.chunk.sizes))
        if tuple(chunk.shape) != tuple(data.chunk.sizes):
            raise ValueError(f"{key}: the source gives a chunk of shape {tuple(chunk.shape)} at "
                             f"{tuple(data.chunk.offsets)}, the model's is {tuple(data.chunk.sizes)}")
        return chunk.to(data.properties.dtype).contiguous()


def dist_save_streamed(sharded_state_dict: dict, directory: str | Path, resolve: Callable[..., torch.Tensor],
                       progress: bool = True) -> None:
    """What :func:`dist_save` writes for ``sharded_state_dict``, with the tensors' data from ``resolve(key, offsets,
    sizes)``.

    ``sharded_state_dict`` is that of a model on the meta device in a world of one process (only its structure is
    read); ``resolve`` returns the chunk at ``offsets`` of ``sizes`` of the global tensor stored under a checkpoint
    key, e.g. ``decoder.layers.3.mlp.linear_fc2.weight`` (or one layer of a stacked ``decoder.layers.mlp.linear_fc2
    .weight``). The common state and ``metadata.json`` are written as megatron-core's ``save`` writes them.
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
