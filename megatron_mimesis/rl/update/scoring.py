"""Log-probs of given tokens under the training model, without grad: how the CSD teacher (the current weights
with a coach's note in context) re-scores the tokens the student sampled.

Rows are packed into THD micro-batches of at most ``max_tokens_per_microbatch`` tokens (memory is bounded by
that, not by the batch) and run through megatron's forward-only schedule; the last pipeline stage computes each
response token's log-prob from its hidden states with the fused kernel (no logits tensor) and shares the
result with the other stages. Collective over the model-parallel group: every rank of it passes the same rows.
"""

from dataclasses import replace
from functools import partial

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.pipeline_parallel import get_forward_backward_func

from megatron_mimesis.data.collate import packed_seq_params
from megatron_mimesis.kernels import fused_linear_logprobs
from megatron_mimesis.rl.types import TrainingRow
from megatron_mimesis.rl.update.policy_step import plan_microbatches
from megatron_mimesis.rl.update.rows import StepRows
from megatron_mimesis.training.loss import fused_loss_inputs


def _logprob_output_processor(target_ids, *, hidden_states, output_layer, output_weight, config, **_):
    hidden, weight, vocab_size = fused_loss_inputs(hidden_states, output_layer, output_weight, config)
    return fused_linear_logprobs(hidden, weight, target_ids.reshape(-1),
                                 tp_group=parallel_state.get_tensor_model_parallel_group(), vocab_size=vocab_size)


def _forward_step(data_iterator, model):
    batch = next(data_iterator)
    output = model(batch["tokens"], batch["position_ids"], None, packed_seq_params=packed_seq_params(batch),
                   output_processor=partial(_logprob_output_processor, batch["labels"]))
    return output, lambda logprobs, non_loss_data=False: logprobs.float()


@torch.no_grad()
def score_rows(model_chunks, rows: list[tuple[list[int], list[int]]], max_tokens_per_microbatch: int,
               device) -> list[list[float]]:
    """For each ``(context_ids, response_ids)``: log p(response token | everything before it), on every rank."""
    if not rows:
        return []
    step = StepRows.of(rows)  # in the policy step's micro-batch format; only tokens, labels and positions matter here
    plan = plan_microbatches(step.lengths.tolist(), 1, max_tokens_per_microbatch)[0]
    tp = parallel_state.get_tensor_model_parallel_world_size()
    pad_to = tp if model_chunks[0].config.sequence_parallel else 1
    streams = [step.microbatches(plan, None, pad_to, device) for _ in range(len(model_chunks))]
    iterators = [batches for batches, _ in streams] if len(streams) > 1 else streams[0][0]
    if parallel_state.get_pipeline_model_parallel_world_size() > 1:
        model_chunks[0].config.variable_seq_lengths = True
    for m in model_chunks:
        m.eval()
    outputs = get_forward_backward_func()(
        forward_step_func=_forward_step, data_iterator=iterators, model=model_chunks, num_microbatches=len(plan),
        seq_length=streams[0][1], micro_batch_size=1, forward_only=True,
        collect_non_loss_data=True,
    )
    for m in model_chunks:
        m.train()
    result: list[list[float] | None] = [None] * len(rows)
    if parallel_state.is_pipeline_last_stage(ignore_virtual=True):
        for mb, logprobs in zip(plan, outputs, strict=True):
            offset = 0
            for i in mb:
                context, response = rows[i]
                start = offset + len(context) - 1  # position t predicts token t + 1
                result[i] = logprobs[start:start + len(response)].tolist()
                offset += len(context) + len(response)
    if parallel_state.get_pipeline_model_parallel_world_size() > 1:
        payload = [result]
        dist.broadcast_object_list(payload, src=parallel_state.get_pipeline_model_parallel_last_rank(),
                                   group=parallel_state.get_pipeline_model_parallel_group())
        result = payload[0]
    return result


def recompute_old_logprobs(model_chunks, rows: list[TrainingRow], max_tokens_per_microbatch: int,
                           device) -> list[TrainingRow]:
    """The rows with the training model's own log-probs of their sampled tokens, taken before the update, and the
    engine's kept beside them (``engine_logprobs``).

    An engine with other numerics (vLLM's bf16 kernels, its own attention and DeltaNet implementations) samples
    from a slightly different distribution than the trainer's; with its log-probs as the PPO ratio's
    denominator, the ratio would start away from 1 and the clipping would act on the mismatch rather than on
    the update. So the ratio is taken against the trainer (as veRL recomputes old log-probs), and the engine's
    log-probs serve the rollout correction (``update/rollout_correction.py``), which reweighs the tokens for having
    been drawn from the engine and reports the mismatch."""
    scored = score_rows(model_chunks, [(r.context_ids, r.response_ids) for r in rows], max_tokens_per_microbatch,
                        device)
    return [replace(row, response_logprobs=trainer, engine_logprobs=row.response_logprobs)
            for row, trainer in zip(rows, scored, strict=True)]
