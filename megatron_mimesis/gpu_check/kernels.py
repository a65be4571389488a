"""The GRPO loss from hidden states at the paper's vocabulary: ours against Liger, torch eager and torch.compile."""

from megatron_mimesis.gpu_check.record import StageRecorder

KERNEL_SHAPES = ((16384, 248320, 4096, 4096), (16384, 248320, 2048, 4096))  # tokens, vocab, hidden, seq_len
KERNEL_PROVIDERS = ("ours", "liger-triton-grpo", "liger-fused-linear-grpo", "torch-eager", "torch-compile")


def stage_kernels(rec: StageRecorder) -> None:
    import torch

    from megatron_mimesis.kernels import bench

    torch.backends.cuda.matmul.allow_tf32 = False  # the fp32 reference must be fp32
    device = torch.device("cuda")
    for tokens, vocab, hidden, seq_len in KERNEL_SHAPES:
        shape = bench.Shape(tokens, vocab, hidden, seq_len)
        x = bench.make_inputs(shape, torch.bfloat16, device)
        expected = bench.fp32_reference(x, chunk=4096)
        lm_ms = bench.lm_head_ms(x, reps=3)
        ours_ms = None
        for provider in KERNEL_PROVIDERS:
            r = bench.bench_provider(provider, shape, x, expected, lm_ms, reps=3)
            if provider == "ours":
                ours_ms = r.fwd_bwd_ms
            rec.row(provider=provider, N=tokens, V=vocab, H=hidden, status=r.status, fwd_bwd_ms=r.fwd_bwd_ms,
                    peak_gib=None if r.peak_mb is None else r.peak_mb / 1024,
                    vs_ours=None if r.fwd_bwd_ms is None or not ours_ms else r.fwd_bwd_ms / ours_ms,
                    vs_lm_head_gemms=None if r.fwd_bwd_ms is None else r.fwd_bwd_ms / lm_ms,
                    loss_err=r.loss_abs_err, grad_h_max_abs=r.grad_h_max_abs, grad_h_cos=r.grad_h_cos)
        rec.note(f"N={tokens} H={hidden}: the 3 bare cuBLAS lm-head GEMMs (logits, grad_h, grad_W) take "
                 f"{lm_ms:.1f} ms; vs_lm_head_gemms = provider time / that (1.0 = as fast as the GEMMs alone)")
        del x, expected
        torch.cuda.empty_cache()
