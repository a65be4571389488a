"""What one checkpoint of a run takes on disk, from the real model the memory plan builds (``states.py``), and how
long it takes to write at a stated filesystem bandwidth.

A dist checkpoint holds every parameter of every pipeline stage once (tensor-parallel shards side by side,
data-parallel replicas once, megatron's padded vocabulary rows included) in its training dtype, and for each parameter the optimizer state that
megatron-core's distributed optimizer saves: its fp32 main copy (saved even when the weights are fp32 themselves)
and Adam's two moments. Gradients are not saved. What it leaves out is a fixed ~0.6 MiB (the ``.metadata`` index,
the RNG states, the run config) plus the tokenizer copy: 8% of the tiny model's checkpoint, nothing at 9B. The norms
replicated across tensor-parallel ranks are counted once per rank, a negligible excess.
"""

import math

from megatron_mimesis.training.memory.states import ADAM_MOMENTS_BYTES, FP32_MASTER_BYTES

# The parallel filesystem's sustained write rate per node that the lead times are planned for (Lustre / GPFS on A100
# clusters sustain 1-5 GB/s per client node; the low end, since the nodes of a job share the filesystem with others).
# Every node writes its ranks' shards at once, so a checkpoint takes its size / (nodes x this).
WRITE_BYTES_PER_S_PER_NODE = 1e9
GPUS_PER_NODE = 8  # the paper's A100 nodes (launch/slurm/*.sbatch)


def checkpoint_bytes(config, stages) -> int:
    """One checkpoint of ``config``, whose pipeline stages the plan built as ``stages`` (``StageStates``)."""
    weight_bytes = 2 if config.bf16 else 4
    main_copy = FP32_MASTER_BYTES if config.bf16 or config.use_distributed_optimizer else 0
    tp = config.tensor_model_parallel_size
    return sum(tp * s.parameters for s in stages) * (weight_bytes + main_copy + ADAM_MOMENTS_BYTES)


def save_seconds(size_bytes: float, world_size: int) -> float:
    """Writing a checkpoint of ``size_bytes`` from ``world_size`` GPUs at ``WRITE_BYTES_PER_S_PER_NODE``."""
    nodes = math.ceil(world_size / GPUS_PER_NODE)
    return size_bytes / (nodes * WRITE_BYTES_PER_S_PER_NODE)


def readable_bytes(n: float) -> str:
    """``n`` bytes in the largest binary unit that keeps a digit before the point (23.8 MiB, not 0.0 GiB)."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"
