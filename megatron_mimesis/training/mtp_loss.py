"""megatron's multi-token-prediction loss, computed as the language-model loss is (``loss.py``): from hidden states
and the output weight, never the logits.

When a run trains the MTP head (``mtp_loss_scaling_factor``), ``GPTModel`` runs its MTP block and then megatron-core's
``process_mtp_loss``, which projects each MTP layer's hidden states onto the whole vocabulary: at Qwen3.5's 248k
tokens and the mid-training row of 24576 tokens, 1.5 G logits per TP rank at TP 4 (2.8 GiB in bf16, and the fp32
cross entropy's copies on top), on the stage that already holds the output layer's. :func:`fused_mtp_loss` takes its
place in ``gpt_model``. It keeps everything else of megatron's:
- labels and mask rolled by megatron's ``roll_tensor``, with packed documents and context parallelism;
- the same scale and normalisation;
- ``MTPLossAutoScaler``, which adds the loss's gradient in backward.

Only the per-token cross entropy comes from ``fused_linear_cross_entropy``. megatron logs through a tracker it makes
on a CUDA device, together with an acceptance rate that needs each token's argmax over the vocabulary. This module
instead keeps per-layer sums, which the trainer logs as ``mtp_loss``.
"""

import torch
from megatron.core.transformer.multi_token_prediction import MTPLossAutoScaler, roll_tensor

from megatron_mimesis.kernels import fused_linear_cross_entropy
from megatron_mimesis.training.loss import fused_loss_inputs

# [loss sum, loss tokens] per MTP layer, one entry per training micro-batch since the last take_mtp_losses()
_logged: list[torch.Tensor] = []


def fused_mtp_loss(hidden_states, labels, loss_mask, output_layer, output_weight, runtime_gather_output, is_training,
                   compute_language_model_loss, config, cp_group=None, tp_group=None, packed_seq_params=None,
                   scale_logits_fn=None, input_ids=None):
    """``process_mtp_loss``'s arguments and result: the main model's hidden states (the first of the 1 + N chunks the
    MTP block concatenated), carrying the MTP layers' loss into backward."""
    if labels is None or scale_logits_fn is not None:
        raise NotImplementedError("the fused MTP loss is a language-model loss on given labels, without MuP scaling")
    chunks = torch.chunk(hidden_states, 1 + config.mtp_num_layers, dim=0)
    weight = output_weight if output_weight is not None else output_layer.weight
    if config.mtp_detach_heads:
        weight = weight.detach()
    mtp_labels = labels.clone()
    loss_mask = torch.ones_like(mtp_labels) if loss_mask is None else loss_mask
    original_tokens = loss_mask.sum()
    scale = config.mtp_loss_scaling_factor / config.mtp_num_layers
    hidden, logged = chunks[0], []
    for depth in range(config.mtp_num_layers):
        mtp_labels, _ = roll_tensor(mtp_labels, shifts=-1, dims=-1, cp_group=cp_group, packed_seq_params=packed_seq_params)
        loss_mask, tokens = roll_tensor(loss_mask, shifts=-1, dims=-1, cp_group=cp_group,
                                        packed_seq_params=packed_seq_params)
        mtp_hidden, weight_shard, vocab_size = fused_loss_inputs(chunks[depth + 1], output_layer, weight, config)
        loss_sum, _ = fused_linear_cross_entropy(
            mtp_hidden, weight_shard, mtp_labels.reshape(-1), loss_mask.reshape(-1).to(mtp_hidden.dtype),
            tp_group=tp_group, normalizer=1.0, vocab_size=vocab_size,
        )
        # With calculate_per_token_loss megatron divides every gradient by the main loss's token count; rolling left
        # the MTP loss fewer tokens, so it is renormalised to its own count, as process_mtp_loss does.
        norm = original_tokens if config.calculate_per_token_loss else 1.0
        hidden = MTPLossAutoScaler.apply(hidden, scale * loss_sum * norm / tokens.clamp(min=1))
        logged.append(torch.stack([loss_sum.detach().float(), tokens.detach().float()]))
    if is_training:
        _logged.append(torch.stack(logged))
    return hidden


def use_fused_mtp_loss() -> None:
    """Make ``GPTModel`` compute its MTP loss with :func:`fused_mtp_loss` (in this process; idempotent)."""
    from megatron.core.models.gpt import gpt_model

    gpt_model.process_mtp_loss = fused_mtp_loss


def take_mtp_losses(num_layers: int, device) -> torch.Tensor:
    """[num_layers, 2]: each MTP layer's loss sum and tokens over the micro-batches run since the last call (zeros on
    a stage without the head), and forget them."""
    total = torch.zeros(num_layers, 2, dtype=torch.float64, device=device)
    for item in _logged:
        total += item.to(total)
    _logged.clear()
    return total
