"""Log-prob of sampled tokens straight from hidden states and the (vocab-sharded) output weight.

Forward (fully fused): every program computes logits tiles h_tile @ W_tile^T with fp32 accumulation over hidden
chunks and folds them into running statistics (vocab_tiles.py); only [splits, N] partials reach memory, never
logits. It also yields the per-token entropy at no extra read.

Backward (chunked): with dL/dl_t known, d l_t / d z_tv = 1[v = y_t] - p_tv. For one chunk of tokens at a time a
Triton kernel recomputes the logits tiles in fp32 and writes d logits = dl * (onehot - exp(z - lse)) in the input
dtype ([chunk, V_local], about 2 GiB); cuBLAS then forms grad_h[chunk] = d logits @ W and a Triton GEMM accumulates
grad_W += d logits^T @ h[chunk] into an fp32 buffer. Why not fully fused: a program owning a tile of tokens cannot hold its
[tokens, H] slice of grad_h in registers at H = 4096, so a fused backward must read-modify-write grad_h and grad_W
in global memory once per (token tile, vocab tile) pair: at N = 65536, V = 248320, H = 4096 and 64-token tiles that
is about 4 TB of fp32 atomic traffic for grad_W alone, far slower than the two GEMMs it replaces. The chunk keeps
memory bounded and independent of N; d logits is rounded to bf16 as in Liger's and Apple's cut-cross-entropy
kernels, with all sums in fp32.

Tensor parallel: the full-vocab statistics are all-reduced (combine_partials), so log-probs equal TP=1. grad_h is
all-reduced here too, returning the TP=1 gradient on every rank: so the caller passes the hidden state *without*
megatron's copy_to_tensor_model_parallel_region, and under sequence parallel gathers it with
``gather_from_sequence_parallel_region(h, tensor_parallel_output_grad=False)`` (whose backward keeps the rank's
slice instead of reduce-scattering). grad_W is the local shard's gradient.
"""

import torch
import torch.distributed as dist
import triton
import triton.language as tl

from .dispatch import interpreting
from .launch_config import launch
from .reference import shard_columns
from .vocab_tiles import (
    combine_partials,
    dot_precision,
    empty_partials,
    geometry,
    mma_operand,
    new_partials,
    online_update,
    store_partials,
)

# Row width of the d logits buffer: a multiple of 16 elements whatever the vocab shard, so its rows stay aligned.
GRAD_ROW_ALIGN = 16


@triton.jit
def _logits_tile(H, W, rows, cols, row_ok, col_ok, hidden_size, stride_h, stride_w,
                 BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr, PRECISION: tl.constexpr,
                 UPCAST: tl.constexpr):
    acc = tl.zeros((BLOCK_N, BLOCK_V), dtype=tl.float32)
    for k0 in range(0, hidden_size, BLOCK_H):
        ks = k0 + tl.arange(0, BLOCK_H)
        k_ok = ks < hidden_size
        h = tl.load(H + rows[:, None] * stride_h + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(W + cols[:, None] * stride_w + ks[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0)
        acc = tl.dot(mma_operand(h, UPCAST), tl.trans(mma_operand(w, UPCAST)), acc, input_precision=PRECISION)
    return acc


@triton.jit
def _forward_kernel(H, W, TARGET, PART, num_tokens, vocab, hidden_size, vocab_start, tiles_per_split, num_splits,
                    stride_h, stride_w, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr,
                    PRECISION: tl.constexpr, UPCAST: tl.constexpr):
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
        z = _logits_tile(H, W, rows, cols, row_ok, col_ok, hidden_size, stride_h, stride_w,
                         BLOCK_N, BLOCK_V, BLOCK_H, PRECISION, UPCAST)
        run_max, run_sum, run_sum_z, target = online_update(z, cols, col_ok, local_target, run_max, run_sum,
                                                            run_sum_z, target)
    store_partials(PART, rows, row_ok, split, num_splits, num_tokens, run_max, run_sum, run_sum_z, target)


@triton.jit
def _grad_logits_kernel(H, W, TARGET, LSE, DLOGPROB, GRAD_LOGITS, num_tokens, vocab, hidden_size, vocab_start,
                        tiles_per_split, stride_h, stride_w, grad_stride, BLOCK_N: tl.constexpr,
                        BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """d logits = dl * (onehot - exp(z - lse)) for one chunk of tokens, z recomputed in fp32. Rows of GRAD_LOGITS
    are ``grad_stride`` (a multiple of 16) wide and written in full, zeros past ``vocab``: with a row stride and a
    store mask of unknown alignment the stores are not vectorised and the kernel spills on sm_80."""
    split = tl.program_id(1)
    rows = tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < num_tokens
    dlogprob = tl.load(DLOGPROB + rows, mask=row_ok, other=0.0)
    has_grad = tl.max(tl.abs(dlogprob), axis=0) > 0.0  # masked token tiles skip the recomputation
    local_target = tl.load(TARGET + rows, mask=row_ok, other=-1) - vocab_start
    lse = tl.load(LSE + rows, mask=row_ok, other=0.0)
    first = split * tiles_per_split
    last = tl.minimum(first + tiles_per_split, tl.cdiv(vocab, BLOCK_V))
    for tile in range(first, last):
        cols = (tile * BLOCK_V + tl.arange(0, BLOCK_V)).to(tl.int64)
        col_ok = cols < vocab
        dz = tl.zeros((BLOCK_N, BLOCK_V), tl.float32)
        if has_grad:
            z = _logits_tile(H, W, rows, cols, row_ok, col_ok, hidden_size, stride_h, stride_w,
                             BLOCK_N, BLOCK_V, BLOCK_H, PRECISION, UPCAST)
            onehot = tl.where(cols[None, :] == local_target[:, None], 1.0, 0.0)
            dz = dlogprob[:, None] * (onehot - tl.exp(z - lse[:, None]))
        dz = tl.where(col_ok[None, :], dz, 0.0)
        tl.store(GRAD_LOGITS + rows[:, None] * grad_stride + cols[None, :], dz.to(GRAD_LOGITS.dtype.element_ty),
                 mask=row_ok[:, None] & (cols < grad_stride)[None, :])


def backward_chunk_tokens(vocab: int, element_size: int) -> int:
    """Tokens per backward chunk on a GPU: about 2 GiB of d logits (4096 tokens at vocab 248320 in bf16), large
    enough for the GEMMs to run near peak (the memory plan reads it too)."""
    return max(256, (2 << 30) // (vocab * element_size) // 256 * 256)


def _chunk_tokens(vocab: int, element_size: int) -> int:
    """:func:`backward_chunk_tokens`; under the interpreter 32 tokens, so CPU tests cross chunk boundaries."""
    return 32 if interpreting() else backward_chunk_tokens(vocab, element_size)


@triton.jit
def _accumulate_grad_weight_kernel(GRAD_LOGITS, H, GRAD_W, num_tokens, vocab, hidden_size, stride_h, grad_stride,
                                   BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr,
                                   PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """GRAD_W[v_tile, h_tile] += GRAD_LOGITS[:, v_tile]^T @ H[:, h_tile] over one chunk of tokens. Each program
    owns its fp32 output tile (no atomics) and reads it once per chunk; products run on the tensor cores.

    The chunk's product is summed first and the fp32 tile read only after the loop: a [BLOCK_V, BLOCK_H] block of
    64-bit output pointers kept alive across the loop costs 128 registers a thread at 128 x 128 tiles. Loads of
    GRAD_LOGITS are masked at its (16-aligned) row width, whose columns past ``vocab`` are zeros."""
    cols = tl.program_id(0).to(tl.int64) * BLOCK_V + tl.arange(0, BLOCK_V)
    ks = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    k_ok = ks < hidden_size
    acc = tl.zeros((BLOCK_V, BLOCK_H), tl.float32)
    for t0 in range(0, num_tokens, BLOCK_K):
        rows = (t0 + tl.arange(0, BLOCK_K)).to(tl.int64)
        row_ok = rows < num_tokens
        dz = tl.load(GRAD_LOGITS + rows[:, None] * grad_stride + cols[None, :],
                     mask=row_ok[:, None] & (cols < grad_stride)[None, :], other=0.0)
        h = tl.load(H + rows[:, None] * stride_h + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        acc = tl.dot(tl.trans(mma_operand(dz, UPCAST)), mma_operand(h, UPCAST), acc, input_precision=PRECISION)
    out = GRAD_W + cols[:, None] * hidden_size + ks[None, :]
    out_ok = (cols < vocab)[:, None] & k_ok[None, :]
    tl.store(out, acc + tl.load(out, mask=out_ok, other=0.0), mask=out_ok)


def _accumulate_grad_weight(grad_w, grad_logits, chunk_hidden):
    """grad_w (fp32) += grad_logits^T @ chunk_hidden, so grad_W loses no bits to bf16 rounding across chunks
    (torch's fp32-output addmm for bf16 operands does not accept an fp32 accumulator in every release, and none
    on the CPU, where the interpreter tests run this path)."""
    config = launch("linear_logprob.grad_weight", grad_w.device)
    vocab, hidden_size = grad_w.shape
    grid = (triton.cdiv(vocab, config.constexprs["BLOCK_V"]), triton.cdiv(hidden_size, config.constexprs["BLOCK_H"]))
    _accumulate_grad_weight_kernel[grid](grad_logits, chunk_hidden, grad_w, chunk_hidden.shape[0], vocab,
                                         hidden_size, chunk_hidden.stride(0), grad_logits.stride(0),
                                         PRECISION=dot_precision(chunk_hidden.dtype), UPCAST=interpreting(),
                                         **config.constexprs, **config.options)


class LinearLogprob(torch.autograd.Function):
    """(hidden [N, H], weight [V_local, H], global target ids [N]) -> (logprob [N], entropy [N]), fp32.

    Entropy is a by-product of the same pass and is not differentiable. The kernels only ever see the shard's
    real rows (a contiguous head, see reference.shard_columns); the padding rows' gradient is exactly zero.
    """

    @staticmethod
    def forward(ctx, hidden, weight, target_ids, tp_group, vocab_size):
        if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
            raise ValueError(f"expected hidden [N, H] and weight [V_local, H], got {tuple(hidden.shape)} and "
                             f"{tuple(weight.shape)}")
        if hidden.dtype != weight.dtype:
            raise ValueError(f"hidden and weight must share a dtype for the tensor-core GEMMs, got {hidden.dtype} "
                             f"and {weight.dtype}")
        hidden, weight, target_ids = hidden.contiguous(), weight.contiguous(), target_ids.contiguous()
        vocab_start, real = shard_columns(weight.shape[0], tp_group, vocab_size)
        ctx.weight_rows = weight.shape[0]
        weight = weight[:real]
        num_tokens, hidden_size = hidden.shape
        if real:
            config = launch("linear_logprob.forward", hidden.device)
            geo = geometry(num_tokens, real, config.constexprs["BLOCK_N"], config.constexprs["BLOCK_V"],
                           hidden.device)
            partials = new_partials(num_tokens, geo, hidden.device)
            _forward_kernel[geo.grid](hidden, weight, target_ids, partials, num_tokens, real, hidden_size,
                                      vocab_start, geo.tiles_per_split, geo.splits, hidden.stride(0),
                                      weight.stride(0), PRECISION=dot_precision(hidden.dtype), UPCAST=interpreting(),
                                      **config.constexprs, **config.options)
        else:
            partials = empty_partials(num_tokens, hidden.device)
        logprob, entropy, log_sum_exp = combine_partials(partials, tp_group)
        ctx.save_for_backward(hidden, weight, target_ids, log_sum_exp)
        ctx.tp_group, ctx.vocab_start = tp_group, vocab_start
        ctx.mark_non_differentiable(entropy)
        return logprob, entropy

    @staticmethod
    def backward(ctx, grad_logprob, _grad_entropy):
        hidden, weight, target_ids, log_sum_exp = ctx.saved_tensors
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        # partial grad_h are summed across TP in fp32; without TP each row is written once, in the input dtype
        grad_h = torch.zeros(hidden.shape, dtype=torch.float32 if ctx.tp_group else hidden.dtype,
                             device=hidden.device) if need_h else None
        grad_w = torch.zeros(ctx.weight_rows, weight.shape[1], dtype=torch.float32,
                             device=weight.device) if need_w else None
        if grad_logprob is not None and weight.shape[0]:
            dlogprob = grad_logprob.float().contiguous()
            config = launch("linear_logprob.grad_logits", hidden.device)
            vocab = weight.shape[0]
            row_width = triton.cdiv(vocab, GRAD_ROW_ALIGN) * GRAD_ROW_ALIGN
            chunk = _chunk_tokens(row_width, hidden.element_size())
            for start in range(0, hidden.shape[0], chunk):
                rows = slice(start, start + chunk)
                chunk_hidden = hidden[rows]
                grad_logits = torch.empty(chunk_hidden.shape[0], row_width, dtype=hidden.dtype, device=hidden.device)
                geo = geometry(chunk_hidden.shape[0], vocab, config.constexprs["BLOCK_N"],
                               config.constexprs["BLOCK_V"], hidden.device)
                _grad_logits_kernel[geo.grid](chunk_hidden, weight, target_ids[rows], log_sum_exp[rows],
                                              dlogprob[rows], grad_logits, chunk_hidden.shape[0], vocab,
                                              hidden.shape[1], ctx.vocab_start, geo.tiles_per_split,
                                              hidden.stride(0), weight.stride(0), row_width,
                                              PRECISION=dot_precision(hidden.dtype), UPCAST=interpreting(),
                                              **config.constexprs, **config.options)
                if need_h:
                    grad_h[rows] = grad_logits[:, :vocab] @ weight
                if need_w:
                    _accumulate_grad_weight(grad_w[:vocab], grad_logits, chunk_hidden)
        if ctx.tp_group is not None and need_h:
            dist.all_reduce(grad_h, group=ctx.tp_group)
        return (grad_h.to(hidden.dtype) if need_h else None, grad_w.to(weight.dtype) if need_w else None, None, None,
                None)


def linear_logprob(hidden, weight, target_ids, tp_group=None, vocab_size=None):
    return LinearLogprob.apply(hidden, weight, target_ids, tp_group, vocab_size)
