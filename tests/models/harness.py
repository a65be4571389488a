"""Shared pieces of the model parity tests: the HF reference, batches, and one megatron training step.

Functions that run inside spawned ranks live at module level so that they can be pickled.
"""

import socket

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron_mimesis.models.config import ParallelConfig, transformer_config
from megatron_mimesis.models.hf_weights import gather_hf_tensors, load_hf_weights
from megatron_mimesis.models.presets import get_preset
from megatron_mimesis.models.provider import ModelProvider

PRESET = get_preset("tiny")
QWEN3_PRESET = get_preset("qwen3-tiny")
TINY_PRESETS = [PRESET, QWEN3_PRESET]  # one per family
REPO = __import__("pathlib").Path(__file__).resolve().parents[2]


def hf_reference(seed: int = 0, preset=PRESET):
    """A random-weight transformers model of the preset's family in fp32, with non-trivial norm gains (around 1:
    ``w`` near 0 for a zero-centred norm, Qwen3.5's decoder norms; near 1 for a plain one)."""
    torch.manual_seed(seed)
    model = preset.family.hf_model(preset, attn_implementation="eager").eval()
    zero_centred = preset.family.transformer_fields(preset)["layernorm_zero_centered_gamma"]
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("linear_attn.norm.weight") or ("norm" in name and not zero_centred):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif "norm" in name:
                p.normal_(0.0, 0.2)
    return model


def make_batch(seed: int = 1, batch: int = 2, seq: int = 24, vocab: int = PRESET.vocab_size):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (batch, seq + 1), generator=g)
    mask = (torch.rand(batch, seq, generator=g) < 0.7).float()
    mask[:, 0] = 1.0
    return {"tokens": tokens[:, :-1].contiguous(), "labels": tokens[:, 1:].contiguous(), "loss_mask": mask}


def hf_loss_and_grads(model, batch):
    model.zero_grad()
    logits = model(batch["tokens"]).logits
    per_token = F.cross_entropy(logits.flatten(0, 1).float(), batch["labels"].flatten(), reduction="none")
    mask = batch["loss_mask"].flatten()
    loss = (per_token * mask).sum() / mask.sum()
    loss.backward()
    return loss.item(), {n: p.grad.detach().clone() for n, p in model.named_parameters()}


# megatron's gradients vs transformers', relative to each tensor's largest HF entry
GRAD_TOL = 1e-5


def assert_grads_close(ours: dict, ref: dict, where: str) -> None:
    """Every HF-named gradient of ``ref`` present in ``ours`` and within GRAD_TOL of it."""
    assert set(ours) == set(ref), set(ours) ^ set(ref)
    for name, g in ref.items():
        err = (ours[name] - g).abs().max().item()
        assert err <= GRAD_TOL * max(1.0, g.abs().max().item()), f"{where}: {name} grad differs by {err}"


def init_single_process_megatron():
    """TP=1, PP=1 megatron in this process (idempotent), for tests that need no second rank."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from megatron_mimesis.compat import enable_cpu_compat

    enable_cpu_compat()
    if not dist.is_initialized():
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(1, 1)
    model_parallel_cuda_manual_seed(0)


def build_megatron_from_hf(hf_state, parallel: ParallelConfig, preset=PRESET, **config_overrides):
    config = transformer_config(preset, parallel, **config_overrides)
    provider = ModelProvider(preset, config)
    model = provider()
    load_hf_weights(model, hf_state, preset, provider.padded_vocab_size)
    return model, config, provider


def _forward_step(fused_loss, data_iterator, model):
    """The per-token loss of megatron's own output layer, or (``fused_loss``) the trainer's: the fused kernel's
    masked sum from the hidden states, with no logits tensor."""
    from megatron_mimesis.training.loss import lm_loss_output_processor

    batch = next(data_iterator)
    tokens, mask = batch["tokens"], batch["loss_mask"]
    position_ids = torch.arange(tokens.shape[1]).expand_as(tokens)
    if fused_loss:
        output = model(tokens, position_ids, None, labels=batch["labels"], loss_mask=mask,
                       output_processor=lm_loss_output_processor)
    else:
        output = model(tokens, position_ids, None, labels=batch["labels"])

    def loss_func(output):
        loss = (output.float() if fused_loss else output.float() * mask).sum() / mask.sum()
        return loss, {"loss": loss.detach().clone()}

    return output, loss_func


def megatron_train_step(rank, world_size, tp, pp, sequence_parallel, hf_state, batch, preset=PRESET,
                        fused_loss=False, config_overrides=None):
    """One forward/backward through megatron's schedule with DDP and grad finalisation: the loss (last stage),
    this stage's HF-named grads and weights, and the output layer's local gradient, padding rows included.
    ``config_overrides`` set TransformerConfig fields; with ``mtp_num_layers`` the MTP loss is the trainer's."""
    from functools import partial

    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from megatron_mimesis.compat import enable_cpu_compat
    from megatron_mimesis.training.grads import finalize_grads

    enable_cpu_compat()
    parallel_state.initialize_model_parallel(tp, pp)
    model_parallel_cuda_manual_seed(0)
    parallel = ParallelConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                              sequence_parallel=sequence_parallel)
    if (config_overrides or {}).get("mtp_num_layers"):
        from megatron_mimesis.training.mtp_loss import use_fused_mtp_loss

        use_fused_mtp_loss()
    module, config, provider = build_megatron_from_hf(hf_state, parallel, preset=preset, **(config_overrides or {}))
    model = DistributedDataParallel(config=config, ddp_config=DistributedDataParallelConfig(grad_reduce_in_fp32=True),
                                    module=module)
    config.finalize_model_grads_func = finalize_grads
    model.zero_grad_buffer()
    losses = get_forward_backward_func()(
        forward_step_func=partial(_forward_step, fused_loss), data_iterator=iter([batch]), model=[model],
        num_microbatches=1, seq_length=batch["tokens"].shape[1], micro_batch_size=batch["tokens"].shape[0],
        forward_only=False,
    )
    loss = losses[0]["loss"].item() if losses else None
    output_layer = getattr(module, "output_layer", None)
    result = {
        "loss": loss,
        "grads": gather_hf_tensors(module, preset, provider.padded_vocab_size, grads=True),
        "weights": gather_hf_tensors(module, preset, provider.padded_vocab_size),
        "output_grad": None if output_layer is None else output_layer.weight.main_grad.detach().clone(),
        "padded_vocab_size": provider.padded_vocab_size,
        "tp_rank": parallel_state.get_tensor_model_parallel_rank(),
    }
    parallel_state.destroy_model_parallel()
    return result
