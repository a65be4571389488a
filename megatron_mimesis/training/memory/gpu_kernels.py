"""The saved sets of the GPU kernels that the CPU modules stand in for, so that measuring the real megatron modules
here counts what a GPU run keeps.

On a GPU the Qwen3.5 layers run Transformer Engine (norm + linear, core attention, fused RoPE), flash-linear-attention
(the causal conv, the q/k L2 norm, the chunked gated delta rule) and our Triton loss kernel. Their CPU counterparts
(``models/local_layers.py``, ``compat/fla_fallback.py``, the loss references) compute the same outputs but keep other
tensors for backward: the fp32 norm in local_layers keeps every fp32 intermediate, SDPA keeps what the math path
needs, the torch delta rule keeps every chunk's state, the loss reference materialises the logits. Inside
:func:`gpu_saved_sets` each of them is replaced by a stand-in that returns a tensor of the kernel's output shape
and dtype (zeros: no value is ever read, which also spares the plan their CPU cost) and declares exactly what the
GPU kernel's ``ctx.save_for_backward`` holds, read from that kernel's source:

* TE RMSNorm (``LayerNormLinear``'s norm, ``TENorm``): the input made contiguous (a q/k norm's input is a view into
  the fused qkv projection, whose storage TE's copy lets go) and the fp32 1/rms per row; the normalised output is
  kept by the linear that follows (TE saves its local, not gathered, copy under sequence parallelism).
* TE ``DotProductAttention`` (flash / cuDNN fused attention): q and k as contiguous tensors (RoPE and the q/k norms
  made them new ones), v as it comes, the output, and the fp32 softmax log-sum-exp per head and token; no S x S
  matrix. v is a slice of the fused qkv projection's output along the last dimension, which flash-attn's varlen
  path (THD) takes without a copy (its ``maybe_contiguous`` copies only a non-unit last stride), so the saved v keeps
  the whole projection output alive.
* TE fused RoPE: only the frequencies, which every layer shares (excluded; counted once with the embedding).
* fla ``causal_conv1d``: its input made contiguous (``input_guard``) and the weight.
* fla ``l2norm``: the output and the fp32 1/norm per row.
* fla ``chunk_gated_delta_rule``: q, k, v, beta, the chunk-local cumulative decay g (fp32) and the intra-chunk
  matrix A (64 per head and token, in q's dtype); the chunk states are recomputed in backward, not kept.
* ``kernels/linear_logprob.py`` ``LinearLogprob``: the hidden states, the target ids and the fp32 log-sum-exp.

Everything else (megatron's projections, splits, gates, SwiGLU, residual adds, the loss's elementwise part) runs as
is and is measured. What stays approximate: megatron ``torch.compile``s three small GDN helpers on the GPU
(``jit_fuser``: the gated output norm, the q/k/v preparation, the decay), which run eagerly here; a compiled region
keeps at most what eager keeps, so the plan is an upper bound there.
"""

import contextlib

import torch

from megatron_mimesis.training.memory.saved import SavedTensors

DELTA_RULE_CHUNK = 64  # fla's chunk length: A holds one row of 64 per head and token


def _needs_grad(*inputs) -> bool:
    """Whether the kernel's output joins the autograd graph, which is when its saved tensors are kept (not under
    no_grad, e.g. in the forward of a recomputed region)."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in inputs)


def _keep(needs_grad: bool, *tensors: torch.Tensor) -> None:
    if needs_grad:
        SavedTensors.current().keep(*tensors)


def _keep_new(needs_grad: bool, shape, dtype: torch.dtype) -> None:
    if needs_grad:
        SavedTensors.current().keep_new(shape, dtype)


def _output(tensor: torch.Tensor, needs_grad: bool) -> torch.Tensor:
    """A stand-in's output, of the kernel's shape and dtype (its values are never read): it needs grad where the
    kernel's would, so the ops downstream save what they save in the real graph."""
    return tensor.requires_grad_(needs_grad)


@contextlib.contextmanager
def gpu_saved_sets():
    """Swap the CPU stand-ins of the GPU kernels for versions that declare the kernels' saved sets to the active
    :class:`SavedTensors` (modules built inside bind the stand-ins, so build and measure inside)."""
    from megatron.core.models.common.embeddings import rope_utils
    from megatron.core.ssm.gated_delta_net import common, gdn

    from megatron_mimesis.kernels import reference
    from megatron_mimesis.models import local_layers

    def te_rms_norm(x, weight, eps, zero_centered):
        grad = _needs_grad(x, weight)
        _keep(grad, x.contiguous())
        _keep_new(grad, x.shape[:-1], torch.float32)
        return _output(torch.zeros_like(x), grad)

    def te_attention(self, query, key, value, *args, **kwargs):
        grad = _needs_grad(query, key, value)
        out = query.new_zeros(*query.shape[:-2], query.shape[-2] * value.shape[-1])
        _keep(grad, query.contiguous(), key.contiguous(), value, out)
        _keep_new(grad, query.shape[:-1], torch.float32)
        return _output(out, grad)

    def te_rope_bshd(t, freqs, interleaved=False):
        return _output(torch.zeros_like(t), _needs_grad(t))

    def te_rope_thd(t, cu_seqlens, freqs, cp_size=1, cp_rank=0, interleaved=False):
        return _output(torch.zeros_like(t), _needs_grad(t))

    def fla_conv(x, weight, bias=None, activation=None, initial_state=None, output_final_state=False,
                 cu_seqlens=None, **kwargs):
        grad = _needs_grad(x, weight, bias)
        _keep(grad, x.contiguous())
        return _output(torch.zeros(x.shape, dtype=x.dtype), grad), None

    def fla_l2norm(x, dim=-1, eps=1e-6):
        grad = _needs_grad(x)
        y = torch.zeros(x.shape, dtype=x.dtype)
        _keep(grad, y)
        _keep_new(grad, x.shape[:-1], torch.float32)
        return _output(y, grad)

    def fla_delta_rule(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                       use_qk_l2norm_in_kernel=False, cu_seqlens=None, **kwargs):
        grad = _needs_grad(q, k, v, g, beta)
        _keep(grad, q, k, v, beta)
        _keep_new(grad, g.shape, torch.float32)
        _keep_new(grad, (*k.shape[:-1], DELTA_RULE_CHUNK), k.dtype)
        return _output(torch.zeros(v.shape, dtype=q.dtype), grad), None

    def triton_linear_logprob(hidden, weight, target_ids, tp_group=None, vocab_size=None):
        grad = _needs_grad(hidden, weight)
        _keep(grad, hidden.contiguous(), target_ids.contiguous())
        _keep_new(grad, target_ids.shape, torch.float32)
        logprob = torch.zeros(hidden.shape[0], dtype=torch.float32)
        return _output(logprob, grad), torch.zeros_like(logprob)

    patches = [
        (local_layers, "rms_norm", te_rms_norm),
        (local_layers.PackedDotProductAttention, "forward", te_attention),
        (rope_utils, "fused_apply_rotary_pos_emb", te_rope_bshd),
        (rope_utils, "fused_apply_rotary_pos_emb_thd", te_rope_thd),
        (gdn, "causal_conv1d", fla_conv),
        (common, "l2norm", fla_l2norm),
        (gdn, "chunk_gated_delta_rule", fla_delta_rule),
        (reference, "linear_logprob", triton_linear_logprob),
    ]
    saved = [(owner, name, getattr(owner, name)) for owner, name, _ in patches]
    try:
        for owner, name, replacement in patches:
            setattr(owner, name, replacement)
        yield
    finally:
        for owner, name, original in saved:
            setattr(owner, name, original)
