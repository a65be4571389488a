"""The distributed optimizer's state in a checkpoint, written and read by each data-parallel rank for its own shard,
in model space (one tensor per parameter and state, reshardable to any TP/PP/DP layout).

megatron-core's two reshardable formats both fail at scale. ``fully_reshardable`` all-gathers each tensor-parallel
shard's whole optimizer state on every data-parallel rank at every save (``get_parameter_state_dp_zero``: 27 GB
of host memory per rank at 9B, TP=4) and, since those tensors carry the weights' replica id, only data-parallel
rank 0 writes them; loading reads the whole shard on every rank. ``dp_reshardable`` writes each rank's buckets as
they are, but only reloads at the TP/PP layout that wrote them. megatron's own answer to both,
``fully_sharded_model_space`` (each rank saves its flat slice of each parameter's state under the parameter's
model-space key), relies on ``ShardedTensor.flattened_range``, which megatron-core 0.19 no longer accepts.

This module gives that format back in the form 0.19 stores: a rank's flat slice of a parameter (its range of the
distributed optimizer's buffer, ``param_map[...]["param"]``) is a run of whole rows between two partial ones, so it
is a few N-D boxes of the parameter (:func:`flat_range_boxes`, at most 2 x ndim - 1), each an irregular
``ShardedTensor`` of the same key, global shape and dtype that ``fully_reshardable`` writes
(``optimizer.state.{param,exp_avg,exp_avg_sq}.<weight key>``, a factory's parts as its parts). Nothing is
gathered or copied: every box is a view of the rank's own state, every rank writes its boxes, and a load asks for
the boxes of the loading layout, which torch DCP reads from whatever stored boxes overlap them: at the layout that
wrote it each rank reads its own share; at another, the stored boxes its own overlap (a parameter the new TP splits
along its columns overlaps all of them), one at a time. A checkpoint written ``fully_reshardable`` loads the same
way.

:func:`install` puts :func:`sharded_param_state` in the place of megatron's ``sharded_param_state_fs_model_space``,
so that megatron's own ``sharded_state_dict`` (chained optimizers, the allocation before a load, the common state)
and its ``load_parameter_state_from_fs_model_space`` (the flat slice back into the optimizer) do the rest.
"""

import math
from dataclasses import replace

import torch
from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory
from megatron.core.dist_checkpointing.utils import extract_sharded_tensors_and_factories
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

SHARDING_TYPE = "fully_sharded_model_space"
OPTIMIZER_METADATA = {"distrib_optim_sharding_type": SHARDING_TYPE}
STATE_PREFIX = "optimizer.state"  # the keys fully_reshardable saves under (megatron's model-space prefix)

Box = tuple[tuple[int, ...], tuple[int, ...]]  # (offset, shape) in the parameter's local tensor


def flat_range_boxes(shape: tuple[int, ...], start: int, stop: int) -> list[Box]:
    """The boxes of a C-contiguous tensor of ``shape`` whose elements are exactly the flat range [start, stop), in
    flat order: a partial leading row, the whole rows, a partial trailing row, each split the same way one axis
    down."""
    if start >= stop:
        return []
    if len(shape) <= 1:
        return [((start,), (stop - start,))] if shape else [((), ())]
    inner = math.prod(shape[1:])
    first, last = start // inner, (stop - 1) // inner

    def within(row: int, lo: int, hi: int) -> list[Box]:
        return [((row, *offset), (1, *size)) for offset, size in flat_range_boxes(shape[1:], lo, hi)]

    if first == last:
        if start % inner or stop % inner:
            return within(first, start - first * inner, stop - first * inner)
        return [((first, *(0,) * (len(shape) - 1)), (1, *shape[1:]))]
    boxes = []
    if start % inner:
        boxes += within(first, start % inner, inner)
        first += 1
    whole_end = last + 1 if stop % inner == 0 else last
    if whole_end > first:
        boxes.append(((first, *(0,) * (len(shape) - 1)), (whole_end - first, *shape[1:])))
    if stop % inner:
        boxes += within(last, 0, stop % inner)
    return boxes


def _pieces(sharded, key: str, dtype: torch.dtype, replica_id) -> list[tuple[int, ShardedTensor]]:
    """What one parameter's state is stored as, each with its flat offset in the parameter's local tensor: the
    parameter's own ShardedTensor under ``key``, or the parts its factory splits it into (built on a meta tensor:
    only where each part lies is read)."""
    if not isinstance(sharded, ShardedTensorFactory):
        return [(0, replace(sharded, key=key, data=None, dtype=dtype, replica_id=replica_id))]
    local = torch.empty(sharded.data.shape, dtype=dtype, device="meta")
    parts = [part for part in nested_values(sharded.build_fn(key, local, replica_id, None))]
    for part in parts:
        if not part.data.is_contiguous():
            raise ValueError(f"{sharded.key}: a part of this factory is not a contiguous range of the parameter, so a "
                             f"flat slice of its optimizer state is not a set of boxes of it")
    return sorted(((part.data.storage_offset(), part.without_data()) for part in parts), key=lambda p: p[0])


def _box_tensors(pieces: list[tuple[int, ShardedTensor]], flat: torch.Tensor, start: int) -> list[ShardedTensor]:
    """The ShardedTensors of the flat slice ``flat`` (elements [start, start + numel) of the local parameter): for
    each piece it overlaps, the boxes of the overlap, each a view of ``flat``, in flat order."""
    stop = start + flat.numel()
    tensors = []
    for piece_start, piece in pieces:
        lo, hi = max(start, piece_start), min(stop, piece_start + math.prod(piece.local_shape))
        position = lo - start
        for offset, shape in flat_range_boxes(piece.local_shape, lo - piece_start, hi - piece_start):
            size = math.prod(shape)
            # the axes megatron prepends (the layer of a stacked homogeneous block) become leading axes of 1 in the
            # box itself: torch DCP's view of an irregular ShardedTensor has no prepended axes of its own
            axes = piece.prepend_axis_num
            box = (1,) * axes + shape
            tensors.append(ShardedTensor(
                key=piece.key, data=flat[position:position + size].view(box), dtype=flat.dtype,
                local_shape=box, global_shape=piece.global_shape,
                global_offset=(*piece.global_offset[:axes],
                               *(g + o for g, o in zip(piece.global_offset[axes:], offset, strict=True))),
                axis_fragmentations=None, replica_id=piece.replica_id, prepend_axis_num=0,
                allow_shape_mismatch=piece.allow_shape_mismatch))
            position += size
    return tensors


def _merge(loaded: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for t in loaded])


def _flat_slice(sharded, state_key: str, flat: torch.Tensor, start: int, replica_id) -> ShardedTensorFactory:
    """A factory that stores ``flat`` (the rank's slice of one parameter's ``state_key``) as boxes and merges what
    a load returns back into the flat slice megatron's loader expects."""
    pieces = _pieces(sharded, f"{STATE_PREFIX}.{state_key}.{sharded.key}", flat.dtype, replica_id)
    return ShardedTensorFactory(key=pieces[0][1].key, data=flat,
                                build_fn=lambda key, data, replica, flattened: _box_tensors(pieces, data, start),
                                merge_fn=_merge, replica_id=replica_id)


def sharded_param_state(self: DistributedOptimizer, model_sharded_state_dict, is_loading: bool = False,
                        metadata: dict | None = None) -> dict:
    """This rank's optimizer state (fp32 main parameters, Adam's moments) as boxes of each parameter's model-space
    tensors, in the order of megatron's ``load_parameter_state_from_fs_model_space``. Every data-parallel rank's
    boxes are main replicas (their data-parallel coordinate is the optimizer instance), so each rank writes its own;
    the tensor- and pipeline-parallel coordinates are the weight's, so a replicated norm is written once."""
    by_data = {sh.data: sh for sh in nested_values(extract_sharded_tensors_and_factories(model_sharded_state_dict)[0])}
    state = {}
    for gbuf_range_maps in self.gbuf_ranges:
        for buckets in gbuf_range_maps.values():
            for bucket in buckets:
                for model_param, ranges in bucket["param_map"].items():
                    if model_param not in by_data:
                        raise ValueError(f"a parameter of shape {tuple(model_param.shape)} is not in the model's "
                                         f"sharded state dict")
                    sharded = by_data[model_param]
                    if len(sharded.replica_id) != 3:
                        raise ValueError(f"{sharded.key}: replica id {sharded.replica_id} is not (PP, TP, DP)")
                    replica_id = (*sharded.replica_id[:2], self.distributed_optimizer_instance_id)
                    tensors = self._get_main_param_and_optimizer_states(model_param)
                    state[len(state)] = {
                        name: _flat_slice(sharded, name, tensor, ranges["param"].start, replica_id)
                        for name, tensor in tensors.items() if name != "step"  # step: megatron keeps it per group
                    }
    return state


def install() -> None:
    """Route megatron's ``fully_sharded_model_space`` through :func:`sharded_param_state` (idempotent)."""
    DistributedOptimizer.sharded_param_state_fs_model_space = sharded_param_state


def mark_loaded(optimizer_state) -> None:
    """Say on a loaded optimizer state that its parameter state is this module's, whatever the checkpoint's common
    state recorded (``fully_reshardable`` for a checkpoint written before): what was asked for decides its form."""
    if isinstance(optimizer_state, dict):
        if "param_state_sharding_type" in optimizer_state:
            optimizer_state["param_state_sharding_type"] = SHARDING_TYPE
        for value in optimizer_state.values():
            mark_loaded(value)
