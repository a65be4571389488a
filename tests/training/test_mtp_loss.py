"""The fused MTP loss against megatron-core's own ``process_mtp_loss`` (which computes the full logits), on a packed
row of three documents, where megatron's ``roll_tensor`` keeps each document's shifted labels to itself."""

import torch

from megatron_mimesis.data.collate import packed_seq_params
from megatron_mimesis.models.config import ParallelConfig, transformer_config
from megatron_mimesis.models.provider import ModelProvider
from megatron_mimesis.training.loss import lm_loss_output_processor
from tests.models.harness import PRESET, init_single_process_megatron


def test_the_fused_mtp_loss_is_megatrons_without_the_logits():
    init_single_process_megatron()
    from megatron.core.models.gpt import gpt_model
    from megatron.core.transformer.multi_token_prediction import MTPLossAutoScaler, process_mtp_loss

    from megatron_mimesis.training.mtp_loss import fused_mtp_loss, take_mtp_losses

    preset = PRESET.replace(mtp_num_layers=1)
    config = transformer_config(preset, ParallelConfig(), mtp_num_layers=1, mtp_loss_scaling_factor=0.3,
                                calculate_per_token_loss=True)
    torch.manual_seed(0)
    model = ModelProvider(preset, config)().eval()  # eval: megatron's tracker of training metrics needs CUDA
    g = torch.Generator().manual_seed(1)
    seq = 40
    tokens = torch.randint(0, preset.vocab_size, (1, seq), generator=g)
    mask = (torch.rand(1, seq, generator=g) < 0.8).float()
    cu_seqlens = torch.tensor([0, 11, 27, seq], dtype=torch.int32)
    positions = torch.cat([torch.arange(b - a) for a, b in zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist(), strict=True)])
    packed = packed_seq_params({"cu_seqlens": cu_seqlens, "max_seqlen": 16})
    MTPLossAutoScaler.set_loss_scale(torch.tensor(1.0))

    def loss_and_grads(mtp_loss):
        gpt_model.process_mtp_loss = mtp_loss
        model.zero_grad()
        loss = model(tokens, positions[None], None, labels=torch.roll(tokens, -1, 1), loss_mask=mask,
                     packed_seq_params=packed, output_processor=lm_loss_output_processor)
        loss.backward()
        return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}

    try:
        ref_loss, ref = loss_and_grads(process_mtp_loss)
        loss, fused = loss_and_grads(fused_mtp_loss)
    finally:
        gpt_model.process_mtp_loss = process_mtp_loss
    assert loss == ref_loss
    head = [n for n in ref if n.startswith("mtp.")]
    assert len(head) == 12 and all(ref[n].abs().max() > 0 for n in head)
    for name, grad in ref.items():
        assert torch.allclose(fused[name], grad, rtol=1e-5, atol=1e-6), name
    # evaluation (model.eval()) logs no training loss
    assert not take_mtp_losses(1, "cpu").any()
