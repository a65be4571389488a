"""What one checkpoint of a run takes on disk, from the real model the memory plan builds (``states.py``), which node
writes the most of it, and how long that node takes at the stated filesystem bandwidth.

A dist checkpoint holds every parameter of every pipeline stage once (tensor-parallel shards side by side,
data-parallel replicas once, megatron's padded vocabulary rows included) in its training dtype, and for each parameter the optimizer state that
megatron-core's distributed optimizer saves: its fp32 main copy (saved even when the weights are fp32 themselves)
and Adam's two moments. Gradients are not saved. What it leaves out is a fixed ~0.6 MiB (the ``.metadata`` index,
the RNG states, the run config) plus the tokenizer copy: 8% of the tiny model's checkpoint, nothing at 9B. The norms
replicated across tensor-parallel ranks are counted once per rank, a negligible excess.

*Who writes what.* The save is fully parallel (``checkpoint/trainer_state.py``): each rank writes its own shard of the
distributed optimizer's state, and megatron's ``FullyParallelSaveStrategyWrapper`` spreads the weights every rank of
a data-parallel group holds over that group, largest first, each to the rank that has written least so far
(``distribute_shards_to_ranks``, run here on the sizes of the tensors the rank's weights are saved as). Nothing is
gathered before the write. Ranks fill the nodes in megatron's order (TP fastest, then data parallel, then PP), and
the nodes write at once, so a checkpoint takes as long as its busiest node.
"""

import math

from megatron_mimesis.training.memory.states import ADAM_MOMENTS_BYTES, FP32_MASTER_BYTES

GPUS_PER_NODE = 8  # the paper's A100 nodes (launch/slurm/*.sbatch)


def checkpoint_bytes(config, stages) -> int:
    """One checkpoint of ``config``, whose pipeline stages the plan built as ``stages`` (``StageStates``)."""
    tp = config.tensor_model_parallel_size
    return tp * sum(s.parameters * _weight_bytes(config)
                    + (s.parameters - s.frozen_parameters) * _optimizer_bytes_per_parameter(config) for s in stages)


def _weight_bytes(config) -> int:
    return 2 if config.bf16 else 4


def _optimizer_bytes_per_parameter(config) -> int:
    main_copy = FP32_MASTER_BYTES if config.bf16 or config.use_distributed_optimizer else 0
    return main_copy + ADAM_MOMENTS_BYTES


def rank_write_bytes(config, stage, dp: int) -> list[int]:
    """What each of the ``dp`` ranks of a data-parallel group of pipeline stage ``stage`` writes: its optimizer
    shard, and the weights megatron's fully parallel save gives it (replicated optimizer states, without the
    distributed optimizer, are spread like the weights)."""
    from megatron.core.dist_checkpointing.exchange_utils import distribute_shards_to_ranks

    everyone = list(range(dp))
    sizes, holders = {}, {}
    for i, size in enumerate(stage.weight_shard_bytes):
        sizes[("weight", i)], holders[("weight", i)] = size, everyone
        if not config.use_distributed_optimizer:
            elements = size // _weight_bytes(config)
            sizes[("optimizer", i)] = elements * _optimizer_bytes_per_parameter(config)
            holders[("optimizer", i)] = everyone
    if config.use_distributed_optimizer:
        for rank in everyone:
            sizes[("optimizer shard", rank)] = stage.optimizer_elements * _optimizer_bytes_per_parameter(config)
            holders[("optimizer shard", rank)] = [rank]
    written = [0] * dp
    for shard, rank in distribute_shards_to_ranks(holders, sizes, dp, set()).items():
        written[rank] += sizes[shard]
    return written


def node_write_bytes(config, stages, world_size: int) -> list[int]:
    """What each node of the job writes of one checkpoint: its ranks' shares (:func:`rank_write_bytes`), every
    tensor-parallel rank counted as the first (whose stage the plan built)."""
    tp = config.tensor_model_parallel_size
    dp = config.data_parallel_size(world_size) * config.context_parallel_size
    nodes = [0] * math.ceil(world_size / GPUS_PER_NODE)
    for pipeline_rank, stage in enumerate(stages):
        for dp_rank, written in enumerate(rank_write_bytes(config, stage, dp)):
            for tp_rank in range(tp):
                nodes[(tp_rank + tp * (dp_rank + dp * pipeline_rank)) // GPUS_PER_NODE] += written
    return nodes


def write_seconds(node_bytes: float, config) -> float:
    """Writing ``node_bytes`` from one node at ``config.ckpt_write_gb_per_s``."""
    return node_bytes / (config.ckpt_write_gb_per_s * 1e9)


def readable_bytes(n: float) -> str:
    """``n`` bytes in the largest binary unit that keeps a digit before the point (23.8 MiB, not 0.0 GiB)."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"
