"""Plain-PyTorch stand-ins for the flash-linear-attention kernels that megatron-core's Gated DeltaNet calls.

megatron-core refuses to build ``GatedDeltaNet`` without fla, and its own torch fallbacks (delta rule and
conv) assert ``cu_seqlens is None``. Training on packed rows needs both the causal convolution and the
delta-rule recurrence to restart at every document boundary, so these stand-ins run each packed document
as its own sequence (segment by segment). They keep fla's call signatures so that megatron's layer code
runs unchanged; they are slow and exist for CPU runs and tests, never for GPU training (install the
``[gpu]`` extra there).
"""

import torch
import torch.nn.functional as F


def l2norm(x: torch.Tensor, dim: int = -1, eps: float = 1e-6) -> torch.Tensor:
    """fla's l2norm: x / sqrt(sum(x^2) + eps), computed in fp32."""
    xf = x.float()
    return (xf * torch.rsqrt((xf * xf).sum(dim=dim, keepdim=True) + eps)).to(x.dtype)


def _segments(cu_seqlens, length):
    if cu_seqlens is None:
        return [(0, length)]
    bounds = cu_seqlens.tolist()
    return list(zip(bounds[:-1], bounds[1:], strict=True))


def causal_conv1d(
    x, weight, bias=None, activation=None, initial_state=None, output_final_state=False, cu_seqlens=None, **kwargs
):
    """Depthwise causal conv over [batch, seq, channels] with weight [channels, width], per packed segment."""
    if initial_state is not None or output_final_state:
        raise NotImplementedError("the CPU causal_conv1d fallback has no recurrent conv state (inference only)")
    width = weight.shape[-1]
    channels = x.shape[-1]
    outs = []
    for start, end in _segments(cu_seqlens, x.shape[1]):
        seg = x[:, start:end].transpose(1, 2)
        y = F.conv1d(seg, weight.unsqueeze(1), bias, padding=width - 1, groups=channels)[..., : end - start]
        outs.append(y.transpose(1, 2))
    y = torch.cat(outs, dim=1)
    if activation in ("silu", "swish"):
        y = F.silu(y)
    elif activation is not None:
        raise ValueError(f"unsupported conv activation {activation!r}")
    return y, None


def chunk_gated_delta_rule(
    q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
    use_qk_l2norm_in_kernel=False, cu_seqlens=None, **kwargs,
):
    """fla's chunk_gated_delta_rule signature over megatron's torch chunked recurrence, one segment at a time."""
    from megatron.core.ssm.gated_delta_net.common import torch_chunk_gated_delta_rule

    if scale is not None and abs(scale - q.shape[-1] ** -0.5) > 1e-12:
        raise NotImplementedError("the CPU delta-rule fallback supports only the default 1/sqrt(d_k) scale")
    if initial_state is not None or output_final_state:
        raise NotImplementedError("the CPU delta-rule fallback has no recurrent state (inference only)")
    outs = []
    for start, end in _segments(cu_seqlens, q.shape[1]):
        out, _ = torch_chunk_gated_delta_rule(
            q[:, start:end], k[:, start:end], v[:, start:end], g[:, start:end], beta[:, start:end],
            use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
        )
        outs.append(out)
    return torch.cat(outs, dim=1), None


def install_fla_fallback() -> None:
    """Point megatron-core's GDN modules at the stand-ins when fla is not importable."""
    from megatron.core.ssm.gated_delta_net import common, gdn

    if common.HAVE_FLA:
        return
    common.HAVE_FLA = True
    common.l2norm = l2norm
    common.causal_conv1d = gdn.causal_conv1d = causal_conv1d
    common.chunk_gated_delta_rule = gdn.chunk_gated_delta_rule = chunk_gated_delta_rule
