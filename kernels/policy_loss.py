"""GRPO clipped loss + CSD gated log-likelihood, from hidden states (fused) or from logits.

The student log-prob l_t of each sampled token is computed once, by the tiled Triton engine (or the reference
under ``impl="torch"``), and both terms read it. The rest of the objective (ratio, clip, gate, aggregation) is
O(N) elementwise work on [N] vectors, written once in reference.py and differentiated by autograd, so the kernel
and reference paths cannot disagree on the objective's derivative; the vocab-sized work is all in the kernels.
"""

from . import reference
from .dispatch import resolve_impl, tensor_parallel_group


def _check_options(loss_agg, cu_seqlens, dual_clip_c):
    if loss_agg not in reference.LOSS_AGGREGATIONS:
        raise ValueError(f"loss_agg must be one of {reference.LOSS_AGGREGATIONS}, got {loss_agg!r}")
    if loss_agg == "seq-mean-token-mean" and cu_seqlens is None:
        raise ValueError('loss_agg="seq-mean-token-mean" needs cu_seqlens')
    if dual_clip_c is not None and dual_clip_c <= 1.0:
        raise ValueError(f"dual_clip_c must be > 1, got {dual_clip_c}")


def fused_linear_policy_loss(hidden, weight, target_ids, loss_mask, old_logprobs, advantages, *,
                             teacher_logprobs=None, csd_alpha=0.0, csd_beta=5.0, ref_logprobs=None, kl_coef=0.0,
                             rollout_weights=None, clip_eps_low=0.2, clip_eps_high=0.2, dual_clip_c=None,
                             ratio_upper_clamp=None, loss_agg="token-mean", cu_seqlens=None, normalizer=None,
                             return_entropy=False, tp_group=None, vocab_size=None, impl="auto"):
    """L_GRPO + csd_alpha * L_CSD (+ kl_coef * KL to ``ref_logprobs``) from hidden [N, H] and the output weight shard [V_local, H], never
    materialising the [N, V] logits, with per-token ``rollout_weights`` (rollout correction) on the sampled-token
    terms. Returns (loss, metrics); see reference.policy_loss_from_logprobs.

    Under TP (``tp_group``), ``target_ids`` are global vocab ids, the loss and log-probs equal TP=1, grad_W is
    the local shard's and grad_h is already summed over the group (see linear_logprob.py for how to call it
    from megatron). ``vocab_size``: the model's real vocabulary when the output layer is padded beyond it.
    """
    _check_options(loss_agg, cu_seqlens, dual_clip_c)
    tp_group = tensor_parallel_group(tp_group)
    if resolve_impl(impl, hidden) == "triton":
        from .linear_logprob import linear_logprob
    else:
        linear_logprob = reference.linear_logprob
    logprobs, entropy = linear_logprob(hidden, weight, target_ids, tp_group, vocab_size)
    return reference.policy_loss_from_logprobs(
        logprobs, entropy, loss_mask, old_logprobs, advantages, teacher_logprobs=teacher_logprobs,
        csd_alpha=csd_alpha, csd_beta=csd_beta, ref_logprobs=ref_logprobs, kl_coef=kl_coef,
        rollout_weights=rollout_weights, clip_eps_low=clip_eps_low, clip_eps_high=clip_eps_high,
        dual_clip_c=dual_clip_c, ratio_upper_clamp=ratio_upper_clamp, loss_agg=loss_agg, cu_seqlens=cu_seqlens,
        normalizer=normalizer, return_entropy=return_entropy)


def policy_loss_from_logits(logits, target_ids, loss_mask, old_logprobs, advantages, *, teacher_logprobs=None,
                            csd_alpha=0.0, csd_beta=5.0, ref_logprobs=None, kl_coef=0.0, rollout_weights=None,
                            clip_eps_low=0.2, clip_eps_high=0.2, dual_clip_c=None, ratio_upper_clamp=None,
                            loss_agg="token-mean", cu_seqlens=None, normalizer=None, return_entropy=False,
                            tp_group=None, vocab_size=None, impl="auto"):
    """The same objective from materialised (vocab-sharded) logits [N, V_local]; the gradient is d logits."""
    _check_options(loss_agg, cu_seqlens, dual_clip_c)
    tp_group = tensor_parallel_group(tp_group)
    if resolve_impl(impl, logits) == "triton":
        from .logits_logprob import logits_logprob

        logprobs, entropy = logits_logprob(logits, target_ids, tp_group, vocab_size)
    else:
        logprobs, entropy = reference.logprob_and_entropy_from_logits(logits, target_ids, tp_group, vocab_size)
    return reference.policy_loss_from_logprobs(
        logprobs, entropy, loss_mask, old_logprobs, advantages, teacher_logprobs=teacher_logprobs,
        csd_alpha=csd_alpha, csd_beta=csd_beta, ref_logprobs=ref_logprobs, kl_coef=kl_coef,
        rollout_weights=rollout_weights, clip_eps_low=clip_eps_low, clip_eps_high=clip_eps_high,
        dual_clip_c=dual_clip_c, ratio_upper_clamp=ratio_upper_clamp, loss_agg=loss_agg, cu_seqlens=cu_seqlens,
        normalizer=normalizer, return_entropy=return_entropy)
