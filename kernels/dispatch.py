"""Choosing between the Triton kernels and the PyTorch references (``impl="auto" | "triton" | "torch"``)."""

import importlib.util
import os
import warnings

import torch.distributed as dist

IMPLS = ("auto", "triton", "torch")
_warned = False


def interpreting() -> bool:
    """True when Triton runs kernels on the CPU through its interpreter (the CPU tests)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def resolve_impl(impl: str, tensor) -> str:
    """"auto" picks Triton for CUDA tensors and falls back to the reference elsewhere, warning once, so a CPU
    run of the trainer works unchanged (and slowly) instead of failing."""
    global _warned
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    if impl != "auto":
        return impl
    if tensor.is_cuda and importlib.util.find_spec("triton") is not None:
        return "triton"
    if not _warned:
        warnings.warn("megatron_mimesis.kernels: Triton or CUDA unavailable, using the PyTorch references (the loss "
                      "references materialise the full logits)", stacklevel=3)
        _warned = True
    return "torch"


def tensor_parallel_group(tp_group):
    """The group to all-reduce vocab statistics over, or None when there is nothing to reduce (no group, or a
    group of one rank, as megatron hands out at TP=1)."""
    if tp_group is None or dist.get_world_size(tp_group) == 1:
        return None
    return tp_group
