"""Modules for the local (non-Transformer-Engine) backend that megatron-core does not provide.

megatron-core's local backend wraps ``torch.nn.RMSNorm``, which has neither zero-centred gamma
(Qwen3.5's ``y = norm(x) * (1 + w)``) nor sequence-parallel support, has no fused norm + linear, and its
``DotProductAttention`` rejects packed (THD) sequences. Transformer Engine covers all of these on GPU;
these cover them elsewhere. ``NormColumnParallelLinear`` mirrors TE's ``LayerNormLinear`` down to the
parameter name (``layer_norm_weight``), so a model has the same state-dict keys on either backend and
checkpoints move between a CPU test and a GPU run unchanged.
"""

import torch
import torch.nn.functional as F
from megatron.core.tensor_parallel.layers import ColumnParallelLinear
from megatron.core.transformer.dot_product_attention import DotProductAttention


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centered: bool) -> torch.Tensor:
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    w = weight.float() + 1.0 if zero_centered else weight.float()
    return (y * w).to(x.dtype)


def _norm_weight(config, size: int) -> torch.nn.Parameter:
    init = torch.zeros if config.layernorm_zero_centered_gamma else torch.ones
    weight = torch.nn.Parameter(init(size, dtype=config.params_dtype))
    weight.sequence_parallel = config.sequence_parallel
    return weight


class RMSNorm(torch.nn.Module):
    """RMSNorm computed in fp32, zero-centred when ``config.layernorm_zero_centered_gamma``.

    The weight is replicated across tensor-parallel ranks. Under sequence parallelism each rank sees a
    slice of the sequence, so its gradient is partial: the ``sequence_parallel`` attribute asks megatron's
    grad finalisation to sum it across the TP group (as Transformer Engine's norms do).
    """

    def __init__(self, config, hidden_size: int, eps: float = 1e-6, **kwargs):
        super().__init__()
        self.eps = eps
        self.zero_centered = config.layernorm_zero_centered_gamma
        self.weight = _norm_weight(config, hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps, self.zero_centered)


class NormColumnParallelLinear(ColumnParallelLinear):
    """RMSNorm then a column-parallel linear, as one module (TE's ``LayerNormLinear`` for the local backend).

    Under sequence parallelism the norm runs on this rank's sequence slice before the all-gather, as in TE.
    """

    def __init__(self, input_size: int, output_size: int, *, config, **kwargs):
        super().__init__(input_size, output_size, config=config, **kwargs)
        self.eps = config.layernorm_epsilon
        self.zero_centered = config.layernorm_zero_centered_gamma
        self.layer_norm_weight = _norm_weight(config, input_size)

    def forward(self, input_, weight=None, runtime_gather_output=None):
        normed = rms_norm(input_, self.layer_norm_weight, self.eps, self.zero_centered)
        return super().forward(normed, weight=weight, runtime_gather_output=runtime_gather_output)


class PackedDotProductAttention(DotProductAttention):
    """megatron's local core attention, plus packed rows: causal attention restarted at each document.

    Packed input is THD: query [tokens, heads, dim], key/value [tokens, groups, dim] (grouped-query).
    """

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None, **kwargs):
        if packed_seq_params is None or packed_seq_params.qkv_format != "thd":
            return super().forward(query, key, value, attention_mask, attn_mask_type=attn_mask_type,
                                   attention_bias=attention_bias, packed_seq_params=None, **kwargs)
        if self.pg_collection.cp.size() > 1:
            raise NotImplementedError("packed sequences with context parallelism need Transformer Engine attention")
        cu_seqlens = packed_seq_params.cu_seqlens_q_padded
        if cu_seqlens is None:
            cu_seqlens = packed_seq_params.cu_seqlens_q
        bounds = cu_seqlens.tolist()
        groups = query.shape[1] // key.shape[1]
        outs = []
        for start, end in zip(bounds[:-1], bounds[1:], strict=True):
            q = query[start:end].transpose(0, 1)
            k = key[start:end].transpose(0, 1).repeat_interleave(groups, dim=0)
            v = value[start:end].transpose(0, 1).repeat_interleave(groups, dim=0)
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.softmax_scale)
            outs.append(o.transpose(0, 1))
        out = torch.cat(outs, dim=0)
        return out.reshape(out.shape[0], -1)
