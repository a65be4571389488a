"""Plain-PyTorch stand-ins for the flash-linear-attention kernels that megatron-core's Gated DeltaNet calls.

megatron-core refuses to build ``GatedDeltaNet`` without fla, and its own torch fallbacks (delta rule and
conv) assert ``cu_seqlens is None``. Training on packed rows needs both the causal convolution and the
delta-rule recurrence to restart at every document boundary, so these stand-ins lay the packed documents of a
THD row out as a batch of their own, each right-padded with zeros to the longest, run megatron's batched torch
code once, and pack the real positions back. Both operations are causal, so a document's outputs never see its
padding (nor another document), and the padding of the delta rule (zero keys, values, beta and log-decay) is the
same as the chunk padding megatron's code applies itself. One batched call instead of one call per document
matters on the CPU: megatron's chunked delta rule spends most of its time in a Python loop over the 64 rows of a
chunk, whatever the batch size, and an RL step packs dozens of rollouts into one row. They keep fla's call
signatures so that megatron's layer code runs unchanged; they exist for CPU runs and tests, never for GPU
training (install the ``[gpu]`` extra there).
"""

import torch
import torch.nn.functional as F


def l2norm(x: torch.Tensor, dim: int = -1, eps: float = 1e-6) -> torch.Tensor:
    """fla's l2norm: x / sqrt(sum(x^2) + eps), computed in fp32."""
    xf = x.float()
    return (xf * torch.rsqrt((xf * xf).sum(dim=dim, keepdim=True) + eps)).to(x.dtype)


def _segments(cu_seqlens) -> list[tuple[int, int]]:
    bounds = cu_seqlens.tolist()
    return list(zip(bounds[:-1], bounds[1:], strict=True))


def _as_batch(x: torch.Tensor, segments: list[tuple[int, int]]) -> torch.Tensor:
    """[1, T, ...] packed documents -> [documents, longest, ...], each right-padded with zeros."""
    longest = max(end - start for start, end in segments)
    tail = (0, 0) * (x.dim() - 2)
    return torch.stack([F.pad(x[0, start:end], (*tail, 0, longest - (end - start))) for start, end in segments])


def _packed(y: torch.Tensor, segments: list[tuple[int, int]]) -> torch.Tensor:
    """The inverse of :func:`_as_batch`: the real positions of each document, packed back into [1, T, ...]."""
    return torch.cat([y[i, :end - start] for i, (start, end) in enumerate(segments)]).unsqueeze(0)


def causal_conv1d(
    x, weight, bias=None, activation=None, initial_state=None, output_final_state=False, cu_seqlens=None, **kwargs
):
    """Depthwise causal conv over [batch, seq, channels] with weight [channels, width], per packed document."""
    if initial_state is not None or output_final_state:
        raise NotImplementedError("the CPU causal_conv1d fallback has no recurrent conv state (inference only)")
    segments = None if cu_seqlens is None else _segments(cu_seqlens)
    batch = x if segments is None else _as_batch(x, segments)
    width, length = weight.shape[-1], batch.shape[1]
    y = F.conv1d(batch.transpose(1, 2), weight.unsqueeze(1), bias, padding=width - 1,
                 groups=x.shape[-1])[..., :length].transpose(1, 2)
    if activation in ("silu", "swish"):
        y = F.silu(y)
    elif activation is not None:
        raise ValueError(f"unsupported conv activation {activation!r}")
    return (y if segments is None else _packed(y, segments)), None


def chunk_gated_delta_rule(
    q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
    use_qk_l2norm_in_kernel=False, cu_seqlens=None, **kwargs,
):
    """fla's chunk_gated_delta_rule signature over megatron's torch chunked recurrence, all documents at once."""
    from megatron.core.ssm.gated_delta_net.common import torch_chunk_gated_delta_rule

    if scale is not None and abs(scale - q.shape[-1] ** -0.5) > 1e-12:
        raise NotImplementedError("the CPU delta-rule fallback supports only the default 1/sqrt(d_k) scale")
    if initial_state is not None or output_final_state:
        raise NotImplementedError("the CPU delta-rule fallback has no recurrent state (inference only)")
    if cu_seqlens is None:
        return torch_chunk_gated_delta_rule(q, k, v, g, beta, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)[0], None
    segments = _segments(cu_seqlens)
    out, _ = torch_chunk_gated_delta_rule(*(_as_batch(x, segments) for x in (q, k, v, g, beta)),
                                          use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)
    return _packed(out, segments), None


def install_fla_fallback() -> None:
    """Point megatron-core's GDN modules at the stand-ins when fla is not importable."""
    from megatron.core.ssm.gated_delta_net import common, gdn

    if common.HAVE_FLA:
        return
    common.HAVE_FLA = True
    common.l2norm = l2norm
    common.causal_conv1d = gdn.causal_conv1d = causal_conv1d
    common.chunk_gated_delta_rule = gdn.chunk_gated_delta_rule = chunk_gated_delta_rule
