"""One policy-gradient update on megatron: folded rows -> token-balanced packed micro-batches -> the fused
GRPO (+ CSD) loss on the last stage's hidden states -> an optimizer step.

Each training row is one policy turn: ``context + response`` tokens, with the loss on the response tokens
only (the position before each response token predicts it), the sampler's log-probs of those tokens as the
old log-probs, the row's advantage on every one of its tokens and, when another engine sampled the row, each
token's rollout-correction weight (``rollout_correction.py``; a weight of 0 is a rejected token, off the loss mask);
the rows arrive as tensors (``rows.StepRows``), which cut into the micro-batches. Rows are packed into THD micro-batches
(documents never see each other) of at most ``max_tokens_per_microbatch`` tokens, balanced across
data-parallel ranks by token count; every rank computes the same plan, so all ranks agree on the number of
micro-batches without communicating. The loss is a token mean over the whole step: the fused kernel returns
the sum over its micro-batch and megatron divides the gradients by the step's loss-token count across
micro-batches and data-parallel ranks (``calculate_per_token_loss``).
"""

from dataclasses import dataclass
from functools import partial

import torch
from megatron.core import parallel_state
from megatron.core.pipeline_parallel import get_forward_backward_func

from megatron_mimesis.data.collate import packed_seq_params
from megatron_mimesis.kernels import fused_linear_policy_loss
from megatron_mimesis.rl.update.rows import TOKEN_FIELDS, StepRows
from megatron_mimesis.training.loss import fused_loss_inputs


@dataclass(frozen=True)
class PolicyLossConfig:
    clip_eps_low: float = 0.2
    clip_eps_high: float = 0.2
    dual_clip_c: float | None = None
    csd_alpha: float = 0.0
    csd_beta: float = 5.0
    kl_coef: float = 0.0


def plan_microbatches(lengths: list[int], dp_size: int, max_tokens: int) -> list[list[list[int]]]:
    """Row indices per data-parallel rank per micro-batch: longest rows first onto the lightest rank, then packed
    first-fit into micro-batches of at most ``max_tokens``; every rank gets the same number of micro-batches
    (short ranks get empty ones, which carry no loss)."""
    if max(lengths, default=0) > max_tokens:
        raise ValueError(f"a row of {max(lengths)} tokens exceeds max_tokens_per_microbatch={max_tokens}")
    per_rank: list[list[int]] = [[] for _ in range(dp_size)]
    load = [0] * dp_size
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        r = load.index(min(load))
        per_rank[r].append(i)
        load[r] += lengths[i]
    plans = []
    for rows in per_rank:
        bins: list[list[int]] = []
        room: list[int] = []
        for i in rows:
            fit = next((b for b, free in enumerate(room) if free >= lengths[i]), None)
            if fit is None:
                bins.append([])
                room.append(max_tokens)
                fit = len(bins) - 1
            bins[fit].append(i)
            room[fit] -= lengths[i]
        plans.append(bins)
    count = max(1, max(len(p) for p in plans))
    return [p + [[] for _ in range(count - len(p))] for p in plans]


def _policy_output_processor(loss_config: PolicyLossConfig, weighted: bool, batch: dict, *, hidden_states,
                             output_layer, output_weight, config, **_):
    hidden, weight, vocab_size = fused_loss_inputs(hidden_states, output_layer, output_weight, config)
    flat = {k: batch[k].reshape(-1) for k in TOKEN_FIELDS}
    loss_sum, metrics = fused_linear_policy_loss(
        hidden, weight, flat["labels"], flat["loss_mask"].to(hidden.dtype), flat["old_logprobs"], flat["advantages"],
        teacher_logprobs=flat["teacher_logprobs"] if loss_config.csd_alpha else None,
        csd_alpha=loss_config.csd_alpha, csd_beta=loss_config.csd_beta,
        ref_logprobs=flat["ref_logprobs"] if loss_config.kl_coef else None, kl_coef=loss_config.kl_coef,
        rollout_weights=flat["rollout_weights"] if weighted else None, clip_eps_low=loss_config.clip_eps_low,
        clip_eps_high=loss_config.clip_eps_high, dual_clip_c=loss_config.dual_clip_c, normalizer=1.0,
        tp_group=parallel_state.get_tensor_model_parallel_group(), vocab_size=vocab_size,
    )
    return loss_sum, metrics


def _forward_step(loss_config, weighted, data_iterator, model):
    batch = next(data_iterator)
    output = model(batch["tokens"], batch["position_ids"], None, packed_seq_params=packed_seq_params(batch),
                   output_processor=partial(_policy_output_processor, loss_config, weighted, batch))

    def loss_func(result):
        loss_sum, metrics = result
        tokens = batch["loss_mask"].sum()
        logged = {"loss": torch.stack([loss_sum.detach().clone().float(), tokens.float()])}
        for name in ("pg_loss", "csd_loss", "kl_loss"):  # sums over the micro-batch's tokens (normalizer 1)
            if name in metrics:
                logged[name] = torch.stack([metrics[name].detach().float(), tokens.float()])
        for name in ("clip_frac_low", "clip_frac_high", "approx_kl", "mean_gate", "kl_ref"):
            if name in metrics:  # per-micro-batch means, weighted by tokens when reduced
                logged[name] = torch.stack([metrics[name].detach().float() * tokens, tokens.float()])
        return loss_sum, tokens.to(torch.int), logged

    return output, loss_func


def policy_update(model_chunks, optimizer, rows: StepRows, advantages: torch.Tensor, loss_config: PolicyLossConfig,
                  max_tokens_per_microbatch: int, device) -> dict:
    """One optimizer step on ``rows`` (every data-parallel rank's, :meth:`StepRows.gathered`) with one advantage
    each; collective over all ranks, which must pass identical rows. With a ``rollout_weights`` field the loss weighs
    each token by it. Returns the step's token-mean loss and metrics (on every rank) and the optimizer's grad norm.
    The learning-rate schedule is the caller's: it counts rollout batches, which may take several steps each."""
    weighted = "rollout_weights" in rows.response
    plan = plan_microbatches(rows.lengths.tolist(), parallel_state.get_data_parallel_world_size(),
                             max_tokens_per_microbatch)
    tp = parallel_state.get_tensor_model_parallel_world_size()
    pad_to = tp if model_chunks[0].config.sequence_parallel else 1
    mine = plan[parallel_state.get_data_parallel_rank()]
    for m in model_chunks:
        m.zero_grad_buffer()
    optimizer.zero_grad()
    chunks = len(model_chunks)  # each (virtual) chunk draws its own micro-batches, one at a time, from the host rows
    streams = [rows.microbatches(mine, advantages, pad_to, device) for _ in range(chunks)]
    iterators = [batches for batches, _ in streams] if chunks > 1 else streams[0][0]
    seq_length = streams[0][1]
    if parallel_state.get_pipeline_model_parallel_world_size() > 1:
        model_chunks[0].config.variable_seq_lengths = True  # packed micro-batches differ in length
    losses = get_forward_backward_func()(
        forward_step_func=partial(_forward_step, loss_config, weighted), data_iterator=iterators,
        model=model_chunks, num_microbatches=len(mine), seq_length=seq_length, micro_batch_size=1,
        forward_only=False,
    )
    reduced = _reduce(losses, device)
    lr = optimizer.param_groups[0]["lr"]
    ok, grad_norm, _ = optimizer.step()
    return {**reduced, "lr": lr, "grad_norm": grad_norm, "update_applied": bool(ok), "microbatches": len(mine)}


def _reduce(losses: list[dict], device) -> dict:
    """Token-weighted means over micro-batches, shared by the last pipeline stage with all data-parallel ranks."""
    import torch.distributed as dist

    names = ("loss", "pg_loss", "csd_loss", "kl_loss", "clip_frac_low", "clip_frac_high", "approx_kl", "mean_gate",
             "kl_ref")
    totals = torch.zeros(len(names), 2, dtype=torch.float64, device=device)
    for item in losses:
        for k, name in enumerate(names):
            if name in item:
                totals[k] += item[name].to(totals)
    if parallel_state.get_pipeline_model_parallel_world_size() > 1:
        dist.all_reduce(totals, group=parallel_state.get_pipeline_model_parallel_group())
    dist.all_reduce(totals, group=parallel_state.get_data_parallel_group())
    return {name: (totals[k, 0] / totals[k, 1]).item()
            for k, name in enumerate(names) if totals[k, 1] > 0}
