"""Distributed checkpoints (megatron-core ``dist_checkpointing``, torch_dist format) that resume exactly.

Layout: ``SAVE/iter_0000100/`` (a dist checkpoint plus ``run_config.json`` and ``files.json``, the size and
checksum of every file) and ``SAVE/latest`` holding the iteration, written atomically by ``writer.py``, so a run
killed at any moment leaves ``latest`` on a complete checkpoint. ``--load`` verifies it first
and, when it is missing or damaged anyway (a disk that lost a shard), resumes from the newest complete one and
says what it skipped.

*Fully parallel.* Every rank writes, and at the same layout reads, its own share: the distributed optimizer's state in
model space, each data-parallel rank its own shard of it (``optimizer_state.py``: nothing gathered, reloadable at
another TP/PP/DP layout), and the weights split between the data-parallel ranks by megatron's fully parallel save and load wrappers
(Megatron-LM's ``--ckpt-fully-parallel-save`` / ``--ckpt-fully-parallel-load``), which read each weight once per
data-parallel group and hand it to the others.

One repair lives here. megatron's distributed optimizer, when it falls back to ``torch.optim.Adam`` (no
Transformer Engine / Apex: every CPU run, and GPU installs without them), cannot checkpoint correctly:
``state_dict()`` asserts on a fresh optimizer (no Adam state yet: a save before the first update); loading the parameter state raises
``KeyError: 'step'`` (Adam keeps a per-parameter ``step`` tensor that the checkpoint's parameter state
deliberately omits); and ``load_state_dict`` gives every parameter the *same* ``step`` tensor, which Adam
then increments once per parameter per step, so the bias correction after a resume is silently wrong.
:func:`_fresh_adam_state`, :func:`_prepare_adam_for_load` and :func:`_unshare_adam_steps` fix all three around
megatron's calls.
"""

import json
import re
import shutil
import sys
import time
import warnings
from contextlib import contextmanager
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing, parallel_state
from megatron.core.dist_checkpointing.mapping import ShardedObject
from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue
from megatron.core.dist_checkpointing.strategies.fully_parallel import FullyParallelLoadStrategyWrapper
from megatron.core.dist_checkpointing.strategies.torch import TorchDistLoadShardedStrategy
from torch.distributed.checkpoint.api import CheckpointException
from tqdm import tqdm

from data_prep.tokenizer import copy_tokenizer
from megatron_mimesis.checkpoint import optimizer_state, retention
from megatron_mimesis.checkpoint.integrity import record_files, verify_files, verify_written
from megatron_mimesis.checkpoint.reader import (
    RUN_CONFIG,
    TOKENIZER_SUBDIR,
    CheckpointError,
    checkpoint_dir,
    checkpoint_iteration,
    newest_complete,
    published_iterations,
)
from megatron_mimesis.checkpoint.writer import publish, save_request
from megatron_mimesis.failures import root_cause

optimizer_state.install()


def _unwrap(chunk):
    """The GPTModel inside megatron's DDP wrapper: checkpoint keys carry no wrapper prefix."""
    return getattr(chunk, "module", chunk)


def _inner_torch_optimizers(optimizer):
    chained = getattr(optimizer, "chained_optimizers", None) or [optimizer]
    return [opt.optimizer for opt in chained if isinstance(getattr(opt, "optimizer", None), torch.optim.Optimizer)]


def _prepare_adam_for_load(optimizer) -> None:
    """Give torch Adam an (empty) state to be loaded into, and let megatron skip the per-parameter ``step``."""
    for opt in getattr(optimizer, "chained_optimizers", None) or [optimizer]:
        setter = getattr(opt, "_set_main_param_and_optimizer_states", None)
        if setter is not None and not getattr(setter, "_skips_step", False):
            def set_states(model_param, tensors, _set=setter):
                _set(model_param, {"step": None, **tensors})  # non-tensor entries are skipped by megatron

            set_states._skips_step = True
            opt._set_main_param_and_optimizer_states = set_states
    _fresh_adam_state(optimizer)


def _fresh_adam_state(optimizer) -> None:
    """The state torch Adam creates at its first step (step 0, zero moments) for each parameter that has none yet:
    what a load fills, and what a save before the first update writes (an RL step whose rollouts all failed trains
    nothing; its checkpoint is that of a fresh optimizer). The next step is the same as from no state."""
    for inner in _inner_torch_optimizers(optimizer):
        if not isinstance(inner, torch.optim.Adam | torch.optim.AdamW):
            continue
        for group in inner.param_groups:
            for p in group["params"]:
                if p not in inner.state or not inner.state[p]:
                    inner.state[p] = {
                        "step": torch.tensor(0.0),
                        "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
                        "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format),
                    }


def _unshare_adam_steps(optimizer) -> None:
    for inner in _inner_torch_optimizers(optimizer):
        for state in inner.state.values():
            if isinstance(state.get("step"), torch.Tensor):
                state["step"] = state["step"].detach().clone()


def _rng_state() -> ShardedObject:
    """This rank's generators, one object per (PP, TP, DP) rank: resume continues every random stream."""
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    state = {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
        "tracker": get_cuda_rng_tracker().get_states(),
    }
    pp, tp, dp = (
        parallel_state.get_pipeline_model_parallel_rank(),
        parallel_state.get_tensor_model_parallel_rank(),
        parallel_state.get_data_parallel_rank(),
    )
    shape = (
        parallel_state.get_pipeline_model_parallel_world_size(),
        parallel_state.get_tensor_model_parallel_world_size(),
        parallel_state.get_data_parallel_world_size(),
    )
    return ShardedObject("rng_state", state, shape, (pp, tp, dp), replica_id=0)


def _restore_rng(state: dict) -> None:
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    torch.set_rng_state(state["torch"])
    if state["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    get_cuda_rng_tracker().set_states(state["tracker"])


def _model_state(model_chunks) -> dict:
    return {("model" if len(model_chunks) == 1 else f"model{i}"): _unwrap(chunk).sharded_state_dict()
            for i, chunk in enumerate(model_chunks)}


def _sharded_state_dict(model_chunks, optimizer, scheduler, progress: dict, *, is_loading: bool, rng: bool) -> dict:
    state = _model_state(model_chunks)
    # nested per chunk, not merged: virtual pipeline chunks share module names (each holds its own decoder.layers.0)
    model_sd = dict(state)
    if is_loading:
        _prepare_adam_for_load(optimizer)
    else:
        _fresh_adam_state(optimizer)
    state["optimizer"] = optimizer.sharded_state_dict(model_sd, is_loading=is_loading,
                                                      metadata=optimizer_state.OPTIMIZER_METADATA)
    state["opt_param_scheduler"] = scheduler.state_dict()
    state["progress"] = progress
    if rng:
        state["rng_state"] = _rng_state()
    return state


class CheckpointSaveError(RuntimeError):
    """A save that failed, raised on every rank alike with the failing rank's reason: the ranks leave the run
    together (none is left waiting in a collective for a rank that is gone) and the reason is reported once."""


class CheckpointSaver:
    """The checkpoints a run writes under ``root``: ``root/iter_N`` atomically, then ``latest`` (collective over all
    ranks, called at the same points of the loop on every rank).

    Each save is megatron-core's save request (``writer.save_request``): run here (``asynchronous=False``), or by a
    forked writer while training goes on, the step paying only the copy of its state to host memory; at most one is
    in flight. Either way the checkpoint is published (listed in ``files.json``, renamed, ``latest`` moved) only
    once every rank's write is complete and its shards hold what ``.metadata`` says: a crash before that leaves
    ``latest`` on the previous checkpoint.

    Before each save the parameter all-gather is completed. With ``overlap_param_gather`` megatron defers a step's
    all-gather to the next forward, so right after ``optimizer.step()`` each data-parallel rank's buffer holds the new
    values of its own shard only, and the replicated weights written (from data-parallel rank 0) would mix two steps.
    Megatron-LM forces the sync before every save; so does :meth:`save`.

    The tokenizer the run trained with is copied into ``iter_N/tokenizer`` (its files only: a run may name a model
    directory as its tokenizer) so that a checkpoint exports to a complete HF directory even after the data cache it
    came from has changed.

    Retention (``keep_last_n``, ``keep_every``: ``retention.py``) deletes older checkpoints after a publication, and
    only once the published checkpoint verifies against its ``files.json`` where it now lies; a checkpoint that does
    not verify is neither counted nor deleted.
    """

    def __init__(self, root: str | Path, *, asynchronous: bool, keep_last_n: int | None, keep_every: int | None):
        self.root = Path(root)
        self.keep_last_n, self.keep_every = keep_last_n, keep_every
        self._calls = AsyncCallsQueue() if asynchronous else None
        self._writing: int | None = None  # the iteration whose write is in flight
        self.last_saved: int | None = None  # the iteration this run last saved (or resumed from) in root

    def save(self, iteration: int, model_chunks, optimizer, scheduler, progress: dict, run_config: dict,
             tokenizer_dir: str | Path | None = None) -> None:
        self.wait()
        _complete_param_gather(model_chunks)
        tmp = checkpoint_dir(self.root, iteration).with_name(checkpoint_dir(self.root, iteration).name + ".tmp")

        def fresh_directory():
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)

        _on_rank_zero(fresh_directory, self._failed(iteration))
        self.last_saved = iteration
        state = _sharded_state_dict(model_chunks, optimizer, scheduler, progress, is_loading=False, rng=True)
        with self._failures_raised(iteration):
            request = save_request(state, tmp, forked=self._calls is not None, parallel_group=_data_parallel_group())
            request.add_finalize_fn(partial(self._publish, tmp, iteration, run_config, tokenizer_dir,
                                            time.monotonic()))
            if self._calls is None:
                request.execute_sync()
            else:
                self._calls.schedule_async_request(request)
                self._writing = iteration

    def poll(self) -> None:
        """Publish the checkpoint in flight if every rank's write has finished; returns at once otherwise."""
        self._finalize(blocking=False)

    def wait(self) -> None:
        """Publish the checkpoint in flight, waiting for its write."""
        self._finalize(blocking=True)

    def _finalize(self, blocking: bool) -> None:
        if self._writing is None:
            return
        with self._failures_raised(self._writing):
            try:
                self._calls.maybe_finalize_async_calls(blocking=blocking)
            finally:
                if blocking or not self._calls.get_num_unfinalized_calls():
                    self._writing = None

    def _publish(self, tmp: Path, iteration: int, run_config: dict, tokenizer_dir, started: float) -> None:
        def publish_on_rank_zero():
            (tmp / RUN_CONFIG).write_text(json.dumps(run_config, indent=2, sort_keys=True))
            if tokenizer_dir is not None:
                copy_tokenizer(tokenizer_dir, tmp / TOKENIZER_SUBDIR)
            problem = verify_written(tmp)
            if problem:
                raise CheckpointError(problem)
            record_files(tmp)
            publish(tmp, self.root, iteration)
            self._retire_older(iteration)
            # one line per save for the person reading the job's output (tqdm.write: below a progress bar, if any)
            tqdm.write(f"saved checkpoint iteration {iteration} in {self.root} "
                       f"({time.monotonic() - started:.1f} s after the save began)")

        _on_rank_zero(publish_on_rank_zero, self._failed(iteration))

    def _retire_older(self, published: int) -> None:
        """Delete the checkpoints retention no longer keeps, once ``published`` verifies where it now lies."""
        if self.keep_last_n is None:
            return
        problem = verify_files(checkpoint_dir(self.root, published))
        if problem:
            raise CheckpointError(f"{problem}; no older checkpoint deleted")
        retention.remove_leftovers(self.root)
        complete = [i for i in published_iterations(self.root) if verify_files(checkpoint_dir(self.root, i)) is None]
        for iteration in retention.deletable(complete, published, self.keep_last_n, self.keep_every):
            retention.delete(checkpoint_dir(self.root, iteration))

    def _failed(self, iteration: int) -> str:
        return f"save of iteration {iteration} to {self.root} failed"

    @contextmanager
    def _failures_raised(self, iteration: int):
        """A failure of megatron's save or of its finalization, which it raises on every rank (the reason on the
        first rank only), as a ``CheckpointSaveError`` naming the error behind it."""
        try:
            yield
        except CheckpointSaveError:
            raise
        except (Exception, CheckpointException) as exc:
            raise CheckpointSaveError(f"{self._failed(iteration)}: {root_cause(exc)}") from exc


def _on_rank_zero(step, failed: str) -> None:
    """Run ``step`` on rank 0 and raise its failure on every rank: the others learn of it in the broadcast instead of
    waiting in a barrier for a rank that has left."""
    reason = None
    if dist.get_rank() == 0:
        try:
            step()
        except Exception as exc:
            reason = f"{failed}: {root_cause(exc)}"
    shared = [reason]
    dist.broadcast_object_list(shared, src=0)
    if shared[0] is not None:
        raise CheckpointSaveError(shared[0])


def _complete_param_gather(model_chunks) -> None:
    for chunk in model_chunks:
        ddp_config = getattr(chunk, "ddp_config", None)
        if ddp_config is not None and ddp_config.use_distributed_optimizer and ddp_config.overlap_param_gather:
            chunk.start_param_sync(force_sync=True)


def _saved_run_config(path: Path, preset) -> dict:
    """The checkpoint's run_config.json, refusing a checkpoint of another model than ``preset`` with the differing
    fields named."""
    from megatron_mimesis.models.presets import architecture_differences, preset_from_record

    config_path = path / RUN_CONFIG
    if not config_path.exists():
        raise CheckpointError(f"{config_path}: missing; not a checkpoint written by this project")
    saved = json.loads(config_path.read_text())
    try:
        diff = architecture_differences(preset_from_record(saved["preset"], str(config_path)), preset)
    except ValueError as exc:
        raise CheckpointError(str(exc)) from None
    if diff:
        raise CheckpointError(f"{path}: checkpoint is of another model (checkpoint vs config: {'; '.join(diff)})")
    return saved


def load_checkpoint(root: str | Path, model_chunks, optimizer, scheduler, preset, *,
                    restore_rng: bool = True) -> dict:
    """Restore model, optimizer, scheduler (and RNG, at the same layout) from ``root/latest``; returns ``progress``.

    RNG streams are per rank, so they are restored only when the layout is the one that saved them.
    """
    path = _resumable(root)
    saved = _saved_run_config(path, preset)
    if saved.get("model_only"):
        raise CheckpointError(f"{path}: holds weights only (an imported checkpoint); start from it with --finetune")
    same_layout = saved.get("layout") == current_layout()
    state = _sharded_state_dict(model_chunks, optimizer, scheduler, {}, is_loading=True,
                                rng=restore_rng and same_layout)
    loaded = _parallel_load(state, path)
    _load_model(model_chunks, loaded)
    optimizer_state.mark_loaded(loaded["optimizer"])
    try:
        optimizer.load_state_dict(loaded["optimizer"])
    except KeyError as exc:  # megatron keys parameter groups by their hyperparameters
        raise CheckpointError(f"{path}: optimizer parameter groups differ from the checkpoint's ({exc}): resume "
                              f"with the optimizer settings it was saved with, or start from it with --finetune") from None
    _unshare_adam_steps(optimizer)
    scheduler.load_state_dict(loaded["opt_param_scheduler"])
    if "rng_state" in loaded:
        _restore_rng(loaded["rng_state"])
    return loaded["progress"]


def load_model_weights(root: str | Path, model_chunks, preset) -> int:
    """Only the weights of ``root/latest`` (Megatron's --finetune: a new stage starts at iteration 0 with a fresh
    optimizer, e.g. SFT from the mid-training checkpoint, at any layout); returns the source iteration."""
    path = _resumable(root)
    _saved_run_config(path, preset)
    _load_model(model_chunks, _parallel_load(_model_state(model_chunks), path))
    return checkpoint_iteration(path)


def _data_parallel_group():
    """The group whose ranks hold the same weights: the one a fully parallel save or load splits them over."""
    return parallel_state.get_data_parallel_group(with_context_parallel=True)


def _parallel_load(state: dict, path: Path) -> dict:
    """megatron's fully parallel load of ``state`` from ``path``: each weight is read by one rank of the data-parallel
    group and broadcast to the others; what only one rank asks for (its optimizer shard) it reads itself."""
    strategy = FullyParallelLoadStrategyWrapper(TorchDistLoadShardedStrategy(), _data_parallel_group())
    with warnings.catch_warnings():  # megatron reads the common state with DCP's single-process load, in the old
        for notice in _COMMON_STATE_NOTICES:  # argument order: two warnings per rank at every load, about nothing
            warnings.filterwarnings("ignore", message=re.escape(notice))
        return dist_checkpointing.load(state, str(path), sharded_strategy=strategy)


_COMMON_STATE_NOTICES = ("torch.distributed is disabled, unavailable or uninitialized, assuming the intent is to load",
                         "The argument order of load has been changed")


def _resumable(root: str | Path) -> Path:
    """The checkpoint ``--load`` reads; one loud line (rank 0) when it is not the one ``latest`` names."""
    path, skipped = newest_complete(root)
    if skipped and dist.get_rank() == 0:
        print(f"warning: resuming from {path}, the newest complete checkpoint; skipped: {'; '.join(skipped)}",
              file=sys.stderr, flush=True)
    return path


def _load_model(model_chunks, loaded) -> None:
    for i, chunk in enumerate(model_chunks):
        _unwrap(chunk).load_state_dict(loaded["model" if len(model_chunks) == 1 else f"model{i}"])


def current_layout() -> dict:
    return {
        "tensor_model_parallel_size": parallel_state.get_tensor_model_parallel_world_size(),
        "pipeline_model_parallel_size": parallel_state.get_pipeline_model_parallel_world_size(),
        "data_parallel_size": parallel_state.get_data_parallel_world_size(),
    }
