"""Log-prob of sampled tokens from already materialised (vocab-sharded) logits [N, V_local], for callers that
have logits anyway. Same tiled statistics and TP combination as the hidden-state engine; the backward writes
d logits = dl * (onehot - softmax) tile by tile in the logits dtype, recomputing the softmax from the saved
log-sum-exp instead of keeping a probability tensor. Padding columns (reference.shard_columns) are never read and
get a zero gradient.
"""

import torch
import triton
import triton.language as tl

from .launch_config import launch
from .reference import shard_columns
from .vocab_tiles import (
    combine_partials,
    empty_partials,
    geometry,
    new_partials,
    online_update,
    store_partials,
)


@triton.jit
def _forward_kernel(LOGITS, TARGET, PART, num_tokens, vocab, vocab_start, tiles_per_split, num_splits, stride,
                    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr):
    split = tl.program_id(1)
    rows = tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < num_tokens
    local_target = tl.load(TARGET + rows, mask=row_ok, other=-1) - vocab_start
    run_max = tl.full((BLOCK_N,), float("-inf"), tl.float32)
    run_sum = tl.zeros((BLOCK_N,), tl.float32)
    run_sum_z = tl.zeros((BLOCK_N,), tl.float32)
    target = tl.zeros((BLOCK_N,), tl.float32)
    first = split * tiles_per_split
    last = tl.minimum(first + tiles_per_split, tl.cdiv(vocab, BLOCK_V))
    for tile in range(first, last):
        cols = (tile * BLOCK_V + tl.arange(0, BLOCK_V)).to(tl.int64)
        col_ok = cols < vocab
        z = tl.load(LOGITS + rows[:, None] * stride + cols[None, :], mask=row_ok[:, None] & col_ok[None, :],
                    other=0.0).to(tl.float32)
        run_max, run_sum, run_sum_z, target = online_update(z, cols, col_ok, local_target, run_max, run_sum,
                                                            run_sum_z, target)
    store_partials(PART, rows, row_ok, split, num_splits, num_tokens, run_max, run_sum, run_sum_z, target)


@triton.jit
def _backward_kernel(LOGITS, TARGET, LSE, DLOGPROB, GRAD_LOGITS, num_tokens, vocab, vocab_start, tiles_per_split,
                     stride, grad_stride, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr):
    split = tl.program_id(1)
    rows = tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < num_tokens
    dlogprob = tl.load(DLOGPROB + rows, mask=row_ok, other=0.0)
    local_target = tl.load(TARGET + rows, mask=row_ok, other=-1) - vocab_start
    lse = tl.load(LSE + rows, mask=row_ok, other=0.0)
    first = split * tiles_per_split
    last = tl.minimum(first + tiles_per_split, tl.cdiv(vocab, BLOCK_V))
    for tile in range(first, last):
        cols = (tile * BLOCK_V + tl.arange(0, BLOCK_V)).to(tl.int64)
        ok = row_ok[:, None] & (cols < vocab)[None, :]
        offsets = rows[:, None] * stride + cols[None, :]
        z = tl.load(LOGITS + offsets, mask=ok, other=0.0).to(tl.float32)
        onehot = tl.where(cols[None, :] == local_target[:, None], 1.0, 0.0)
        dz = dlogprob[:, None] * (onehot - tl.exp(z - lse[:, None]))
        tl.store(GRAD_LOGITS + rows[:, None] * grad_stride + cols[None, :], dz.to(GRAD_LOGITS.dtype.element_ty),
                 mask=ok)


class LogitsLogprob(torch.autograd.Function):
    """(logits [N, V_local], global target ids [N]) -> (logprob [N], entropy [N]), fp32; entropy not
    differentiable. Under TP the statistics are all-reduced; the logits gradient is the local shard's."""

    @staticmethod
    def forward(ctx, logits, target_ids, tp_group, vocab_size):
        if logits.stride(-1) != 1:
            logits = logits.contiguous()
        target_ids = target_ids.contiguous()
        num_tokens = logits.shape[0]
        vocab_start, real = shard_columns(logits.shape[1], tp_group, vocab_size)
        geo = None
        if real:
            config = launch("logits_logprob.forward", logits.device)
            geo = geometry(num_tokens, real, config.constexprs["BLOCK_N"], config.constexprs["BLOCK_V"],
                           logits.device)
            partials = new_partials(num_tokens, geo, logits.device)
            _forward_kernel[geo.grid](logits, target_ids, partials, num_tokens, real, vocab_start,
                                      geo.tiles_per_split, geo.splits, logits.stride(0), **config.constexprs,
                                      **config.options)
        else:
            partials = empty_partials(num_tokens, logits.device)
        logprob, entropy, log_sum_exp = combine_partials(partials, tp_group)
        ctx.save_for_backward(logits, target_ids, log_sum_exp)
        ctx.vocab_start, ctx.geo, ctx.real = vocab_start, geo, real
        ctx.mark_non_differentiable(entropy)
        return logprob, entropy

    @staticmethod
    def backward(ctx, grad_logprob, _grad_entropy):
        logits, target_ids, log_sum_exp = ctx.saved_tensors
        if grad_logprob is None:
            return None, None, None, None
        # the padding columns keep their zeros
        grad_logits = (torch.zeros if ctx.real < logits.shape[1] else torch.empty)(
            logits.shape, dtype=logits.dtype, device=logits.device)
        if ctx.real:
            config = launch("logits_logprob.backward", logits.device)
            _backward_kernel[ctx.geo.grid](logits, target_ids, log_sum_exp, grad_logprob.float().contiguous(),
                                           grad_logits, logits.shape[0], ctx.real, ctx.vocab_start,
                                           ctx.geo.tiles_per_split, logits.stride(0), grad_logits.stride(0),
                                           **config.constexprs, **config.options)
        return grad_logits, None, None, None


def logits_logprob(logits, target_ids, tp_group=None, vocab_size=None):
    return LogitsLogprob.apply(logits, target_ids, tp_group, vocab_size)
