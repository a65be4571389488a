"""Gradient finalisation after backward: megatron-core's, plus the one reduction it misses (Gated DeltaNet's output norm).

megatron-core's ``finalize_model_grads`` sums across the TP group the gradients of replicated parameters
that each rank only partly sees: norms under sequence parallelism and q/k layernorms. The Gated
DeltaNet's output norm is replicated too, but each TP rank applies it to its own value heads, so its
gradient is partial whenever TP > 1; megatron sums it only under sequence parallelism (via the norm's
``sequence_parallel`` flag). Without sequence parallelism this function sums it.
"""

import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.distributed import finalize_model_grads
from megatron.core.ssm.gated_delta_net import GatedDeltaNet


def _deltanet_out_norm_grads(model_chunks):
    for chunk in model_chunks:
        for module in chunk.modules():
            if isinstance(module, GatedDeltaNet):
                for param in module.out_norm.parameters():
                    if param.requires_grad:
                        yield getattr(param, "main_grad", None) if hasattr(param, "main_grad") else param.grad


def finalize_grads(model_chunks, num_tokens=None, *args, **kwargs):
    """Drop-in for ``config.finalize_model_grads_func``."""
    finalize_model_grads(model_chunks, num_tokens, *args, **kwargs)
    config = model_chunks[0].config
    tp_group = parallel_state.get_tensor_model_parallel_group()
    if config.sequence_parallel or dist.get_world_size(tp_group) == 1:
        return
    for grad in _deltanet_out_norm_grads(model_chunks):
        if grad is not None:
            dist.all_reduce(grad, group=tp_group)
