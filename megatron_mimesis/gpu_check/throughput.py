"""Qwen3.5-9B layers at length 24576 on this GPU, and the extrapolation to the paper's layout."""

import time

from megatron_mimesis.gpu_check.record import StageRecorder
from megatron_mimesis.gpu_check.world import init_one_rank_megatron

THROUGHPUT_SEQ = 24576
THROUGHPUT_LAYERS = 4
PAPER_LAYERS, PAPER_TP = 32, 4


def stage_throughput(rec: StageRecorder) -> None:
    import torch

    from megatron_mimesis.models.config import ParallelConfig, transformer_config
    from megatron_mimesis.models.presets import get_preset
    from megatron_mimesis.models.provider import ModelProvider
    from megatron_mimesis.training.flops import device_peak_flops, train_flops_per_token
    from megatron_mimesis.training.loss import lm_loss_output_processor

    init_one_rank_megatron()
    preset = get_preset("9b").replace(num_layers=THROUGHPUT_LAYERS, mtp_num_layers=0)
    config = transformer_config(preset, ParallelConfig(), params_dtype=torch.bfloat16)
    model = ModelProvider(preset, config, backend="te")().cuda()
    tokens = torch.randint(0, preset.vocab_size, (1, THROUGHPUT_SEQ), device="cuda")
    positions = torch.arange(THROUGHPUT_SEQ, device="cuda")[None]
    mask = torch.ones(1, THROUGHPUT_SEQ, device="cuda")

    def step():
        loss = model(tokens, positions, None, labels=tokens, loss_mask=mask, output_processor=lm_loss_output_processor)
        loss.backward()

    for _ in range(2):  # warm-up: Triton autotuning and compilation, TE workspace
        step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    reps = 5
    started = time.perf_counter()
    for _ in range(reps):
        step()
    torch.cuda.synchronize()
    seconds = (time.perf_counter() - started) / reps
    peak_flops = device_peak_flops(torch.cuda.get_device_name(0))
    tokens_per_s = THROUGHPUT_SEQ / seconds
    flops = train_flops_per_token(preset, THROUGHPUT_SEQ) * tokens_per_s
    rec.row(layers=f"{THROUGHPUT_LAYERS} (3 DeltaNet + 1 attention) + lm head", seq=THROUGHPUT_SEQ,
            step_s=seconds, tokens_per_s=tokens_per_s, tflops=flops / 1e12, mfu=flops / peak_flops if peak_flops else None,
            peak_gib=torch.cuda.max_memory_allocated() / 2**30, gpu_gib=torch.cuda.get_device_properties(0).total_memory / 2**30)
    # the lm head + fused loss alone, to separate it from the per-layer cost in the extrapolation
    hidden = torch.randn(THROUGHPUT_SEQ, preset.hidden_size, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    weight = model.output_layer.weight
    from megatron_mimesis.kernels import fused_linear_cross_entropy

    def head():
        fused_linear_cross_entropy(hidden, weight, tokens[0], mask[0], vocab_size=preset.vocab_size)[0].backward()

    head()
    torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(reps):
        head()
    torch.cuda.synchronize()
    head_s = (time.perf_counter() - started) / reps
    per_layer_s = (seconds - head_s) / THROUGHPUT_LAYERS
    full = get_preset("9b")
    full_step_s = (PAPER_LAYERS * per_layer_s + head_s) / PAPER_TP
    full_tokens_per_gpu = THROUGHPUT_SEQ / full_step_s / PAPER_TP
    full_mfu = full_tokens_per_gpu * train_flops_per_token(full, THROUGHPUT_SEQ) / peak_flops if peak_flops else None
    rec.row(layers=f"extrapolated: {PAPER_LAYERS} layers at TP={PAPER_TP}", seq=THROUGHPUT_SEQ, step_s=full_step_s,
            tokens_per_s=full_tokens_per_gpu, mfu=full_mfu)
    rec.note(f"measured lm head + fused loss alone: {head_s * 1e3:.1f} ms; per layer (averaged over the 3:1 mix): "
             f"{per_layer_s * 1e3:.1f} ms")
    rec.note(f"extrapolation assumes: layers cost the same as the measured 3:1 mix, TP={PAPER_TP} splits every "
             "layer's and the head's work perfectly with no communication cost, no pipeline bubble, embedding and "
             "optimizer step not counted: an upper bound; tokens_per_s of that row is per GPU")
