"""Masked cross entropy for mid-training and SFT on the same tiled engine as the policy loss: at length 24576
and vocab 248320 the bf16 logits of one sequence alone are 12 GB, so the language-model loss never builds them.
"""

from . import reference
from .dispatch import resolve_impl, tensor_parallel_group


def fused_linear_cross_entropy(hidden, weight, target_ids, loss_mask, *, tp_group=None, normalizer=None,
                               vocab_size=None, impl="auto"):
    """sum(m * -log p(y)) / normalizer from hidden [N, H] and the output weight shard [V_local, H].

    ``normalizer`` defaults to this call's loss-token count; pass the global count over data-parallel ranks and
    micro-batches for exact gradient accumulation. ``vocab_size``: the model's real vocabulary, when the output
    layer is padded beyond it (see reference.shard_columns). Called from megatron with hidden from the last stage (gathered
    first under sequence parallel) and the output layer's weight shard; TP semantics as in linear_logprob.py.
    Returns (loss, {"num_tokens", "mean_nll"}).
    """
    tp_group = tensor_parallel_group(tp_group)
    if resolve_impl(impl, hidden) == "triton":
        from .linear_logprob import linear_logprob
    else:
        linear_logprob = reference.linear_logprob
    logprobs, _ = linear_logprob(hidden, weight, target_ids, tp_group, vocab_size)
    return reference.cross_entropy_from_logprobs(logprobs, loss_mask, normalizer)


def fused_linear_logprobs(hidden, weight, target_ids, *, tp_group=None, vocab_size=None, impl="auto"):
    """Per-token log p(y) [N] from hidden [N, H] and the output weight shard, on the same engine: how a teacher or
    reference model scores given tokens (under no_grad) without materialising the logits."""
    tp_group = tensor_parallel_group(tp_group)
    if resolve_impl(impl, hidden) == "triton":
        from .linear_logprob import linear_logprob
    else:
        linear_logprob = reference.linear_logprob
    return linear_logprob(hidden, weight, target_ids, tp_group, vocab_size)[0]
