"""The language-model loss, taken from the last stage's hidden states so that full logits never exist.

megatron's ``GPTModel`` hands its final hidden states to an ``output_processor`` hook; ours feeds them with
the (vocab-sharded) output weight to ``fused_linear_cross_entropy``. The hook returns the *sum* of masked
token losses: the schedule runs with ``calculate_per_token_loss`` so that megatron divides the gradients by
the loss-token count of the whole global batch (all micro-batches, all data-parallel ranks), not by a
per-micro-batch mean.
"""

import torch
from megatron.core import parallel_state
from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

from megatron_mimesis.kernels import fused_linear_cross_entropy
from megatron_mimesis.models.config import real_vocab


def fused_loss_inputs(hidden_states, output_layer, output_weight, config):
    """GPTModel's [s, b, h] final hidden states (sequence-sharded under SP) -> what the fused losses take instead of
    logits: token-major [b*s, h], the output weight shard (the embedding when tied) and, as ``vocab_size``, the
    model's real vocabulary, so that the rows megatron pads the output layer with never enter a softmax."""
    if config.sequence_parallel:
        # The fused losses all-reduce their hidden-state gradient over TP themselves (every rank gets the full
        # one), so the gather's backward must only keep this rank's slice, not reduce-scatter (summing again).
        hidden_states = gather_from_sequence_parallel_region(hidden_states, tensor_parallel_output_grad=False)
    weight = output_weight if output_weight is not None else output_layer.weight
    hidden = hidden_states.transpose(0, 1).reshape(-1, hidden_states.shape[-1])
    return hidden, weight, real_vocab(output_layer)


def lm_loss_output_processor(*, hidden_states, output_layer, output_weight, labels, loss_mask, config, **_):
    """[s, b, h] hidden states (sequence-sharded under SP) -> summed masked cross entropy (a scalar)."""
    hidden, weight, vocab_size = fused_loss_inputs(hidden_states, output_layer, output_weight, config)
    loss_sum, _ = fused_linear_cross_entropy(
        hidden, weight, labels.reshape(-1), loss_mask.reshape(-1).to(hidden.dtype),
        tp_group=parallel_state.get_tensor_model_parallel_group(), normalizer=1.0, vocab_size=vocab_size,
    )
    return loss_sum


def loss_func(loss_mask: torch.Tensor, documents: torch.Tensor, loss_sum: torch.Tensor):
    """megatron schedule contract with ``calculate_per_token_loss``: (loss, token count, logged values).

    The logged pairs are reduced over micro-batches (and data-parallel ranks by the trainer) before dividing:
    the loss and its tokens, and ``documents`` (the micro-batch's sum of squared document lengths and of lengths,
    :func:`document_stats`), from which MFU counts the attention each token does within its own document.
    """
    num_tokens = loss_mask.sum().to(torch.int)
    logged = torch.stack([loss_sum.detach().clone().float(), num_tokens.float()])
    return loss_sum, num_tokens, {"lm loss": logged, "documents": documents}


def document_stats(cu_seqlens: torch.Tensor) -> torch.Tensor:
    """[sum of squared document lengths, sum of lengths] of a packed micro-batch (float64): the attended length per
    token, sum L^2 / sum L, is what causal attention costs a token of a packed row whose documents never attend to
    each other (``training/flops.py``)."""
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).double()
    return torch.stack([lengths.square().sum(), lengths.sum()])
