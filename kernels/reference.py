"""Plain fp32 PyTorch specifications of every loss kernel (DESIGN.md, "Loss semantics").

These are deliberately unfused and materialise the full logits: they are the definition the Triton kernels are
tested against, and the ``impl="torch"`` path. The per-token objective functions (GRPO clip, CSD gate, aggregation)
work on [N] vectors and are shared by the fused path, which only replaces the expensive part: the log-prob of the
sampled token from hidden states and a (vocab-sharded) output weight.
"""

import torch
import torch.distributed as dist

LOSS_AGGREGATIONS = ("token-mean", "seq-mean-token-mean")
ROLLOUT_CORRECTIONS = ("off", "tis", "mis")
ROLLOUT_CORRECTION_LEVELS = ("token", "sequence")
# |log ratio| bound before exp (veRL's safety bound): a token the engine gave -inf cannot make an inf weight
LOG_RATIO_BOUND = 20.0


class _AllReduceForwardIdentityBackward(torch.autograd.Function):
    """Sum a per-shard partial across the TP group; every rank then computes the same replicated loss, so the
    gradient of that loss w.r.t. the local partial is the incoming gradient itself (no reduction)."""

    @staticmethod
    def forward(ctx, tensor, group):
        tensor = tensor.clone()
        dist.all_reduce(tensor, group=group)
        return tensor

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _IdentityForwardAllReduceBackward(torch.autograd.Function):
    """Megatron's copy_to_tensor_model_parallel_region: the replicated hidden state feeds every vocab shard, so
    its gradient is the sum of the shards' partial gradients."""

    @staticmethod
    def forward(ctx, tensor, group):
        ctx.group = group
        return tensor

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def _fp32_or_wider(tensor):
    """fp32 compute, except fp64 stays fp64 (for gradcheck)."""
    return tensor if tensor.dtype == torch.float64 else tensor.float()


def shard_columns(local_vocab: int, tp_group, vocab_size: int | None = None) -> tuple[int, int]:
    """(first global vocab id held by this rank, how many of its columns are real tokens).

    megatron splits the vocab into equal contiguous shards and pads the output layer to a multiple of 64 x TP; the
    rows from ``vocab_size`` (the model's real vocabulary) on are padding, not tokens: every log-softmax leaves them
    out and they get no gradient, so a padded model scores what its unpadded HF twin scores. At small vocabularies
    and large TP a shard can be all padding (0 real columns). ``vocab_size=None``: every column is real.
    """
    tp_rank, tp_size = (0, 1) if tp_group is None else (dist.get_rank(tp_group), dist.get_world_size(tp_group))
    start = tp_rank * local_vocab
    if vocab_size is None:
        return start, local_vocab
    if not 0 < vocab_size <= local_vocab * tp_size:
        raise ValueError(f"vocab_size={vocab_size} must be in [1, {local_vocab * tp_size}] (the output layer's rows: "
                         f"{local_vocab} per TP shard x {tp_size})")
    return start, max(0, min(local_vocab, vocab_size - start))


def logprob_and_entropy_from_logits(logits, target_ids, tp_group=None, vocab_size=None):
    """Log-prob of each target and the per-token entropy from (possibly vocab-sharded) logits, in fp32.

    Under TP the max, the sum of exponentials, the target logit and the entropy's sum(p z) are combined over
    the group, so every rank gets the TP=1 values. Entropy is a metric and carries no gradient. Padding columns
    (global id >= ``vocab_size``) are sliced off, so their logits get an exact zero gradient.
    """
    vocab_start, real = shard_columns(logits.shape[-1], tp_group, vocab_size)
    logits = _fp32_or_wider(logits)[:, :real]
    local_ids = target_ids.long() - vocab_start
    in_shard = (local_ids >= 0) & (local_ids < real)
    if real:
        max_logit = logits.detach().max(dim=-1).values
    else:  # an all-padding shard contributes nothing to any sum
        max_logit = logits.new_full((logits.shape[0],), float("-inf"))
    if tp_group is not None:
        dist.all_reduce(max_logit, op=dist.ReduceOp.MAX, group=tp_group)
    shifted = logits - max_logit[:, None]
    exp = shifted.exp()
    sum_exp = exp.sum(dim=-1)
    picked = shifted.gather(-1, local_ids.clamp(0, max(real - 1, 0))[:, None])[:, 0] if real else sum_exp
    target = torch.where(in_shard, picked, 0.0)
    sum_exp_shifted = (exp * shifted).detach().sum(dim=-1)
    if tp_group is not None:
        sum_exp = _AllReduceForwardIdentityBackward.apply(sum_exp, tp_group)
        target = _AllReduceForwardIdentityBackward.apply(target, tp_group)
        dist.all_reduce(sum_exp_shifted, group=tp_group)
    log_sum_exp = sum_exp.log()
    entropy = log_sum_exp.detach() - sum_exp_shifted / sum_exp.detach()
    return target - log_sum_exp, entropy


def linear_logprob(hidden, weight, target_ids, tp_group=None, vocab_size=None):
    """Log-prob of each target token (and entropy) from hidden [N, H] and the output weight shard [V_local, H]."""
    if tp_group is not None:
        hidden = _IdentityForwardAllReduceBackward.apply(hidden, tp_group)
    logits = _fp32_or_wider(hidden) @ _fp32_or_wider(weight).t()
    return logprob_and_entropy_from_logits(logits, target_ids, tp_group, vocab_size)


def grpo_per_token_loss(logprobs, old_logprobs, advantages, *, clip_eps_low, clip_eps_high, dual_clip_c=None,
                        ratio_upper_clamp=None):
    """-min(r A, clip(r, 1-eps_low, 1+eps_high) A) with r = exp(l - l_old).

    ``ratio_upper_clamp`` caps r in the unclipped term (two-sided clipping: a huge ratio with A < 0 cannot explode
    the loss); ``dual_clip_c`` (> 1) bounds the loss of negative-advantage tokens by -c A (dual-clip PPO).
    """
    ratio = torch.exp(logprobs - old_logprobs)
    unclipped = ratio if ratio_upper_clamp is None else ratio.clamp(max=ratio_upper_clamp)
    clipped = ratio.clamp(1.0 - clip_eps_low, 1.0 + clip_eps_high)
    loss = -torch.minimum(unclipped * advantages, clipped * advantages)
    if dual_clip_c is not None:
        loss = torch.where(advantages < 0, torch.minimum(loss, -dual_clip_c * advantages), loss)
    return loss


def csd_gate(logprobs, teacher_logprobs, beta):
    """g = sigmoid(beta * stopgrad(teacher - student)): tokens the teacher likes less get a small weight."""
    return torch.sigmoid(beta * (teacher_logprobs - logprobs.detach()))


def sequence_index(cu_seqlens, num_tokens):
    """Sequence number of every token from cumulative sequence lengths [S + 1] (no host sync)."""
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]
    return torch.repeat_interleave(torch.arange(len(lengths), device=cu_seqlens.device), lengths,
                                   output_size=num_tokens)


def aggregate(per_token, loss_mask, loss_agg="token-mean", cu_seqlens=None, normalizer=None):
    """Reduce a per-token loss to a scalar.

    "token-mean": sum(m L) / normalizer, normalizer defaulting to sum(m) of this call. Pass the global count of
    loss tokens over data-parallel ranks and micro-batches to make gradient accumulation exact.
    "seq-mean-token-mean": the token-mean of each sequence (``cu_seqlens``), summed and divided by the normaliser,
    which here counts sequences (default: sequences with at least one loss token in this call).
    """
    mask = loss_mask.float()
    per_token = torch.where(loss_mask.bool(), per_token, 0.0)
    if loss_agg == "token-mean":
        denominator = mask.sum().clamp(min=1.0) if normalizer is None else normalizer
        return per_token.sum() / denominator
    if loss_agg == "seq-mean-token-mean":
        if cu_seqlens is None:
            raise ValueError('loss_agg="seq-mean-token-mean" needs cu_seqlens')
        seq = sequence_index(cu_seqlens, per_token.shape[0])
        num_seqs = cu_seqlens.shape[0] - 1
        seq_sum = per_token.new_zeros(num_seqs).index_add(0, seq, per_token)
        seq_count = mask.new_zeros(num_seqs).index_add(0, seq, mask)
        seq_mean = seq_sum / seq_count.clamp(min=1.0)
        denominator = (seq_count > 0).sum().clamp(min=1) if normalizer is None else normalizer
        return seq_mean.sum() / denominator
    raise ValueError(f"loss_agg must be one of {LOSS_AGGREGATIONS}, got {loss_agg!r}")


def masked_mean(values, loss_mask):
    return torch.where(loss_mask.bool(), values, 0.0).sum() / loss_mask.float().sum().clamp(min=1.0)


def policy_loss_from_logprobs(logprobs, entropy, loss_mask, old_logprobs, advantages, *, teacher_logprobs=None,
                              csd_alpha=0.0, csd_beta=5.0, ref_logprobs=None, kl_coef=0.0, rollout_weights=None,
                              clip_eps_low=0.2, clip_eps_high=0.2, dual_clip_c=None, ratio_upper_clamp=None,
                              loss_agg="token-mean", cu_seqlens=None, normalizer=None, return_entropy=False):
    """L_GRPO + alpha L_CSD (+ kl_coef KL to a reference) from per-token student log-probs, plus detached metrics.

    ``rollout_weights`` (detached, per token; see :func:`rollout_correction_weights`) multiply the terms that are
    Monte-Carlo means over the tokens the rollout engine sampled: the GRPO surrogate, whose samples should come
    from pi_old, and CSD's gated log-likelihood -g l, an expectation over the same samples. The CSD gate itself
    takes no weight: it compares the teacher's and the student's log-prob of one given token, no expectation over
    samples, and weighting it would change which tokens the teacher is said to like. The reference KL takes none
    either (a k3 regulariser, not an unbiased gradient estimate, unweighted in veRL and slime too); nor do the
    metrics, which describe the tokens as sampled. ``None`` leaves the objective exactly as without correction.

    The KL term (with ``ref_logprobs``) is the k3 estimator of KL(new || ref) per token, exp(d) - d - 1 with
    d = ref - new clamped to [-20, 20] and the result to at most 10, as veRL's "low_var_kl": unbiased, always
    non-negative, and bounded when a token's reference log-prob is far off.

    Metrics are means over this call's loss tokens: clip fractions (low: r < 1-eps_low with A < 0, high:
    r > 1+eps_high with A > 0), approx KL (Schulman's k3 estimator of KL(old || new): (r - 1) - log r),
    the mean CSD gate, and the per-token entropy when asked. Masked positions get ratio 1 (their old log-prob may
    be padding), so they can produce neither inf nor NaN, in the loss or its gradient.
    """
    old_logprobs = torch.where(loss_mask.bool(), _fp32_or_wider(old_logprobs), logprobs.detach())
    advantages = _fp32_or_wider(advantages)
    per_token = grpo_per_token_loss(logprobs, old_logprobs, advantages, clip_eps_low=clip_eps_low,
                                    clip_eps_high=clip_eps_high, dual_clip_c=dual_clip_c,
                                    ratio_upper_clamp=ratio_upper_clamp)
    if rollout_weights is not None:
        rollout_weights = _fp32_or_wider(rollout_weights).detach()
        per_token = per_token * rollout_weights
    pg_loss = aggregate(per_token, loss_mask, loss_agg, cu_seqlens, normalizer)
    loss = pg_loss
    with torch.no_grad():
        log_ratio = logprobs - old_logprobs
        ratio = log_ratio.exp()
        metrics = {
            "pg_loss": pg_loss.detach(),
            "clip_frac_low": masked_mean(((ratio < 1.0 - clip_eps_low) & (advantages < 0)).float(), loss_mask),
            "clip_frac_high": masked_mean(((ratio > 1.0 + clip_eps_high) & (advantages > 0)).float(), loss_mask),
            "approx_kl": masked_mean(ratio - 1.0 - log_ratio, loss_mask),
        }
    if teacher_logprobs is not None:
        gate = csd_gate(logprobs, _fp32_or_wider(teacher_logprobs), csd_beta)
        gated_nll = -gate * logprobs
        if rollout_weights is not None:
            gated_nll = gated_nll * rollout_weights
        csd_loss = aggregate(gated_nll, loss_mask, loss_agg, cu_seqlens, normalizer)
        loss = loss + csd_alpha * csd_loss
        metrics["csd_loss"] = csd_loss.detach()
        metrics["mean_gate"] = masked_mean(gate, loss_mask)
    if ref_logprobs is not None:
        log_ratio_ref = (torch.where(loss_mask.bool(), _fp32_or_wider(ref_logprobs), logprobs.detach())
                         - logprobs).clamp(-20.0, 20.0)
        kl = (log_ratio_ref.exp() - log_ratio_ref - 1.0).clamp(max=10.0)
        kl_loss = aggregate(kl, loss_mask, loss_agg, cu_seqlens, normalizer)
        loss = loss + kl_coef * kl_loss
        metrics["kl_loss"] = kl_loss.detach()
        metrics["kl_ref"] = masked_mean(kl.detach(), loss_mask)
    if return_entropy:
        metrics["entropy"] = entropy.detach()
    return loss, metrics


def rollout_correction_weights(trainer_logprobs, engine_logprobs, sequence_ids, *, mode, level, cap):
    """Per-token weights that turn a mean over the engine's samples into one over the trainer's, and the mismatch.

    The rollout engine (vLLM: bf16 kernels, its own attention and recurrent DeltaNet decode) samples token y_t from
    pi_engine, while the update's old log-prob o_t is the trainer's own (pi_old). Every sampled-token mean in the
    loss is then biased by rho_t = pi_old(y_t) / pi_engine(y_t) = exp(o_t - e_t), e_t the engine's log-prob.
    ``level="token"`` takes rho_t per token; ``"sequence"`` the geometric mean over the token's sequence (one row,
    one generation: exp of the mean log ratio), which does not vanish or explode with length as the product would.
    log rho is bounded to +-LOG_RATIO_BOUND first.

    ``mode``: "tis" (truncated IS): w = min(rho, cap), every token kept, the variance bounded by cap; "mis" (masked
    IS): w = rho inside [1/cap, cap] and 0 outside, a 0 being a rejected token that leaves the loss (the caller
    drops it from the loss mask, so it does not count in the token mean either); "off": w = 1, the statistics only.
    Where engine and trainer agree (o = e), rho = exp(0) = 1 exactly, so the weights are exactly 1.

    ``trainer_logprobs``, ``engine_logprobs``: [N] over the sampled tokens only; ``sequence_ids``: [N] the sequence
    each belongs to (0..S-1). Returns (weights [N] in the inputs' dtype, metrics): the k3 estimate of
    KL(engine || trainer) (``engine_kl``), mean and max |o - e| (``engine_logprob_abs_diff``, ``_max``), rho's mean /
    min / max (``is_ratio_*``), the weights' mean, and the share of tokens truncated (tis: rho > cap) or masked
    (mis) as ``is_truncated_frac`` / ``is_masked_frac``.
    """
    if mode not in ROLLOUT_CORRECTIONS:
        raise ValueError(f"mode must be one of {ROLLOUT_CORRECTIONS}, got {mode!r}")
    if level not in ROLLOUT_CORRECTION_LEVELS:
        raise ValueError(f"level must be one of {ROLLOUT_CORRECTION_LEVELS}, got {level!r}")
    if not cap > 1.0:
        raise ValueError(f"cap must be > 1, got {cap}")
    diff = trainer_logprobs - engine_logprobs
    log_ratio = diff
    if level == "sequence":
        num_sequences = int(sequence_ids.max()) + 1 if sequence_ids.numel() else 0
        sums = diff.new_zeros(num_sequences).index_add(0, sequence_ids, diff)
        counts = diff.new_zeros(num_sequences).index_add(0, sequence_ids, torch.ones_like(diff))
        log_ratio = (sums / counts.clamp(min=1.0))[sequence_ids]
    ratio = log_ratio.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND).exp()
    if mode == "tis":
        weights = ratio.clamp(max=cap)
    elif mode == "mis":
        weights = torch.where((ratio >= 1.0 / cap) & (ratio <= cap), ratio, 0.0)
    else:
        weights = torch.ones_like(ratio)
    if not diff.numel():
        return weights, {}
    bounded = diff.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    metrics = {
        "engine_kl": (bounded.exp() - bounded - 1.0).mean(),
        "engine_logprob_abs_diff": diff.abs().mean(),
        "engine_logprob_abs_diff_max": diff.abs().max(),
        "is_ratio_mean": ratio.mean(), "is_ratio_min": ratio.min(), "is_ratio_max": ratio.max(),
        "is_weight_mean": weights.mean(),
    }
    if mode == "tis":
        metrics["is_truncated_frac"] = (ratio > cap).float().mean()
    elif mode == "mis":
        metrics["is_masked_frac"] = (weights == 0).float().mean()
    return weights, metrics


def cross_entropy_from_logprobs(logprobs, loss_mask, normalizer=None):
    """Masked token-mean negative log-likelihood; metrics: loss-token count and the per-call mean NLL."""
    loss = aggregate(-logprobs, loss_mask, "token-mean", normalizer=normalizer)
    with torch.no_grad():
        metrics = {"num_tokens": loss_mask.float().sum(), "mean_nll": masked_mean(-logprobs, loss_mask)}
    return loss, metrics


def group_advantages(rewards, group_ids, rollout_ids=None, *, eps=1e-6, unbiased=True,
                     zero_positive_for_negative_reward=False):
    """FoldGRPO advantages, row by row in Python.

    Each group's mean and std are taken over the first row of each unique rollout id (plain GRPO when
    ``rollout_ids`` is None: every row is its own rollout). A group with one rollout gets mean 0, std 1.
    Every row gets (reward - mean) / (std + eps), except in a group whose rollouts all scored alike (std <= eps),
    where every row gets 0: its rollouts carry no signal, and a row whose own reward differs from the rollouts'
    (agent RL's reward-to-go G_t beside the G_0 the statistics read) would otherwise get (G_t - mean) / eps.
    """
    rewards = rewards.float()
    rollout_ids = torch.arange(len(rewards)) if rollout_ids is None else rollout_ids
    first_reward = {}
    for i in range(len(rewards)):
        first_reward.setdefault((int(group_ids[i]), int(rollout_ids[i])), rewards[i])
    stats = {}
    for group in {g for g, _ in first_reward}:
        values = torch.stack([r for (g, _), r in first_reward.items() if g == group])
        if len(values) < 2:
            stats[group] = (torch.tensor(0.0), torch.tensor(1.0))
        else:
            stats[group] = (values.mean(), values.std(unbiased=unbiased))
    out = torch.empty_like(rewards)
    for i in range(len(rewards)):
        mean, std = stats[int(group_ids[i])]
        out[i] = 0.0 if std <= eps else (rewards[i] - mean) / (std + eps)
        if zero_positive_for_negative_reward and rewards[i] < 0 and out[i] > 0:
            out[i] = 0.0
    return out


def discounted_returns(rewards_per_turn, episode_ids, gamma):
    """Reward-to-go G_t = r_t + gamma G_{t+1} within each episode, turns in row order."""
    rewards = rewards_per_turn.float()
    out = torch.empty_like(rewards)
    running = {}
    for i in reversed(range(len(rewards))):
        episode = int(episode_ids[i])
        running[episode] = rewards[i] + gamma * running.get(episode, 0.0)
        out[i] = running[episode]
    return out
