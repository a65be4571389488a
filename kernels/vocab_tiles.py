"""The tiled engine shared by every log-prob kernel: launch geometry, the online log-sum-exp update of a vocab
tile, and the combination of per-split partial statistics (across vocab splits and across TP ranks).

Each program owns a tile of tokens and one contiguous *split* of the vocab tiles. Token tiles go on grid dim 0
(limit 2**31 - 1) and splits on dim 1, whose count is at most the number of vocab tiles, so no sequence length
can hit the 65535 limit of grid dims 1 and 2. Per program and token it keeps a running max, sum of
exponentials, sum of exponentials times logits (for the entropy) and the target logit, all fp32; the [N, V]
logits never exist. The few [splits, N] partials are combined in PyTorch, together with the TP all-reduces.
The sums are kept relative to the running max, so the entropy and log-prob stay accurate for large logits.
"""

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
import triton
import triton.language as tl

from .dispatch import interpreting

# Partial statistics written by the forward kernels, in this order along dim 0 of the [4, splits, N] buffer.
NUM_PARTIALS = 4


@dataclass(frozen=True)
class Geometry:
    block_n: int
    block_v: int
    token_tiles: int
    tiles_per_split: int
    splits: int

    @property
    def grid(self):
        return (self.token_tiles, self.splits)


def geometry(num_tokens: int, vocab: int, block_n: int, block_v: int, device) -> Geometry:
    """Split the vocab only as much as needed to fill the GPU (about 4 programs per SM): fewer splits mean fewer
    partials to combine. Under the interpreter, aim at 2 splits so the CPU tests exercise the combination."""
    token_tiles = triton.cdiv(max(num_tokens, 1), block_n)
    vocab_tiles = triton.cdiv(vocab, block_v)
    if interpreting() or device.type != "cuda":
        target_programs = 2 * token_tiles
    else:
        target_programs = 4 * torch.cuda.get_device_properties(device).multi_processor_count
    wanted_splits = max(1, target_programs // token_tiles)
    tiles_per_split = math.ceil(vocab_tiles / min(wanted_splits, vocab_tiles))
    return Geometry(block_n, block_v, token_tiles, tiles_per_split, math.ceil(vocab_tiles / tiles_per_split))


@triton.jit
def online_update(z, cols, col_ok, local_target, run_max, run_sum, run_sum_z, target):
    """Fold one [BLOCK_N, BLOCK_V] fp32 logits tile into the running per-token statistics.

    run_sum = sum exp(z - m) and run_sum_z = sum exp(z - m) (z - m) relative to the running max m, so the entropy
    log(run_sum) - run_sum_z / run_sum never subtracts two large numbers, whatever the logits' magnitude.
    """
    shifted_ok = col_ok[None, :]
    new_max = tl.maximum(run_max, tl.max(tl.where(shifted_ok, z, float("-inf")), axis=1))
    rescale = tl.exp(run_max - new_max)
    shifted = tl.where(shifted_ok, z - new_max[:, None], 0.0)
    p = tl.where(shifted_ok, tl.exp(shifted), 0.0)
    # moving the reference point from run_max to new_max shifts every earlier (z - m) by (run_max - new_max);
    # before the first tile run_max is -inf and there is nothing to move
    old_max = tl.where(run_sum > 0.0, run_max, new_max)
    run_sum_z = (run_sum_z + (old_max - new_max) * run_sum) * rescale + tl.sum(p * shifted, axis=1)
    run_sum = run_sum * rescale + tl.sum(p, axis=1)
    target += tl.sum(tl.where(cols[None, :] == local_target[:, None], z, 0.0), axis=1)
    return new_max, run_sum, run_sum_z, target


@triton.jit
def store_partials(PART, rows, row_ok, split, num_splits, num_tokens, run_max, run_sum, run_sum_z, target):
    base = PART + split * num_tokens + rows
    plane = num_splits * num_tokens
    tl.store(base, run_max, mask=row_ok)
    tl.store(base + plane, run_sum, mask=row_ok)
    tl.store(base + 2 * plane, run_sum_z, mask=row_ok)
    tl.store(base + 3 * plane, target, mask=row_ok)


def combine_partials(partials: torch.Tensor, tp_group=None):
    """[4, splits, N] partials -> (logprob, entropy, log_sum_exp), each [N] fp32, equal on every TP rank.

    One MAX all-reduce and one SUM all-reduce of three stacked [N] vectors per call.
    """
    run_max, run_sum, run_sum_z, target = partials.unbind(0)
    max_logit = run_max.max(dim=0).values
    if tp_group is not None:
        dist.all_reduce(max_logit, op=dist.ReduceOp.MAX, group=tp_group)
    offset = run_max - max_logit  # re-reference every split's sums to the global max
    weight = torch.exp(offset)
    # an all-padding TP shard (empty_partials) has run_max -inf and run_sum 0, where offset * run_sum is NaN
    moved_sum_z = torch.where(run_sum > 0, run_sum_z + offset * run_sum, 0.0)
    stats = torch.stack([(run_sum * weight).sum(0), (moved_sum_z * weight).sum(0), target.sum(0)])
    if tp_group is not None:
        dist.all_reduce(stats, group=tp_group)
    sum_exp, sum_exp_shifted, target_logit = stats.unbind(0)
    log_sum_shifted = sum_exp.log()
    # (target - max) - log sum: no rounding of a large log-sum-exp before the subtraction
    logprob = (target_logit - max_logit) - log_sum_shifted
    return logprob, log_sum_shifted - sum_exp_shifted / sum_exp, max_logit + log_sum_shifted


def new_partials(num_tokens: int, geo: Geometry, device) -> torch.Tensor:
    return torch.empty(NUM_PARTIALS, geo.splits, num_tokens, dtype=torch.float32, device=device)


def empty_partials(num_tokens: int, device) -> torch.Tensor:
    """The statistics of a TP shard without a single real column: no max, no mass, no target."""
    partials = torch.zeros(NUM_PARTIALS, 1, num_tokens, dtype=torch.float32, device=device)
    partials[0] = float("-inf")
    return partials


@triton.jit
def mma_operand(x, UPCAST: tl.constexpr):
    """Under the interpreter (Triton 3.8) tl.dot multiplies bf16 operands as raw integer bit patterns, so there the
    operands are upcast to fp32 first (values already rounded to bf16, so the result matches the GPU's)."""
    if UPCAST:
        x = x.to(tl.float32)
    return x


def dot_precision(dtype: torch.dtype) -> str:
    """fp32 inputs get exact fp32 products (the tests' reference dtype); bf16/fp16 use the tensor cores."""
    return "ieee" if dtype == torch.float32 else "tf32"
