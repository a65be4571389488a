"""Model FLOPs per token, for MFU, counted by each family from its own layers (``models/<family>/family.py``).

MFU compares the FLOPs the *model* needs per token with the GPU's peak, so recomputation is not counted
(PaLM's definition; the trainer may do more work than this). Element-wise work (norms, RoPE, SwiGLU, gates,
softmax) is left out; only matrix products are counted, at 2 FLOPs per multiply-add.

Forward FLOPs per token = 2 x the parameters that multiply every token (each layer's projections, the SwiGLU MLP,
the LM head, counted even when tied to the embedding, whose lookup is free) + what grows with the context: causal
attention's scores and values on the full-attention layers (QK^T and AV each 2*S*H*d per token over a full row, a
causal row seeing S/2 keys on average: 2*S*H*d per token and layer), and for Qwen3.5 the chunked gated delta rule
of its DeltaNet layers. A packed row's documents never attend to each other: a document of L tokens costs its tokens
2*L*H*d each, so a step's attention is that of rows of S = sum L^2 / sum L tokens (the "attended length" the
trainer measures from the rows' ``cu_seqlens`` and logs), well below the row length when samples are short (the
paper's ~449-token conversation samples in 24576-token rows: counting whole rows over-reported MFU by ~9%).

Training = 3 x forward (backward computes gradients of activations and of weights, 1x forward each). A run that
trains the multi-token-prediction head (``mtp_loss_scaling_factor``) counts its layer and its second pass through
the LM head too (Qwen3.5-9B at 24576: +15%); a frozen head does no work.

Check against the issue's ~5.8e10 FLOPs per token for Qwen3.5-9B at length 24576: this module gives 5.29e10 for
training (1.76e10 forward). The issue's figure is what the common 6*N shortcut gives with N = all 8.95e9
parameters (6*N = 5.37e10) plus causal attention (0.48e10): 5.85e10. That N includes the 1.02e9-parameter
input embedding, a table lookup that does no matrix product (6*V*h = 0.61e10 of the gap); the remaining
+0.04e10 on our side is the DeltaNet recurrence, which 6*N does not see. At the paper's
717 tokens/s/GPU on A100 this gives 12.2% MFU, the ~12% quoted in DESIGN.md.
"""

from megatron_mimesis.models.family import Preset

# Peak dense bf16 tensor-core FLOP/s per device (vendor datasheets, without sparsity). Keys are matched as
# substrings of torch.cuda.get_device_name(); "cpu" is a nominal 1 TFLOP/s so that CPU runs log an MFU-shaped
# number — it is not a measured peak and CPU MFU means nothing.
PEAK_BF16_FLOPS = {
    "A100": 312e12,
    "H100": 989e12,
    "H200": 989e12,
    "cpu": 1e12,
}


def device_peak_flops(device_name: str) -> float | None:
    """Peak bf16 FLOP/s for a device name such as 'NVIDIA A100-SXM4-80GB' or 'cpu'; None for a device not listed
    (its MFU is not known, which must not stop a run)."""
    for key, value in PEAK_BF16_FLOPS.items():
        if key.lower() in device_name.lower():
            return value
    return None


def peak_for_mfu(device_name: str | None, say) -> float | None:
    """The peak MFU divides by: None on the CPU (an MFU there would be made up) and on a GPU not listed, which
    ``say`` (rank 0's log) reports in one line; the run goes on without MFU."""
    if device_name is None:
        return None
    peak = device_peak_flops(device_name)
    if peak is None:
        say(f"MFU n/a: no peak bf16 FLOP/s known for {device_name!r} (known: {', '.join(sorted(PEAK_BF16_FLOPS))})")
    return peak


def model_flops_per_token(preset: Preset, seq_length: float) -> float:
    """Forward FLOPs per token when attention spans ``seq_length`` tokens: a row's length for one document per row,
    the attended length sum L^2 / sum L for packed documents."""
    return preset.family.forward_flops_per_token(preset, seq_length)


def train_flops_per_token(preset: Preset, seq_length: int, trained_mtp: bool = False) -> float:
    """Forward + backward FLOPs per token (3 x forward), the numerator of MFU; ``trained_mtp``: with the MTP head's."""
    mtp = preset.family.mtp_forward_flops_per_token(preset, seq_length) if trained_mtp else 0.0
    return 3.0 * (model_flops_per_token(preset, seq_length) + mtp)


def mfu(tokens_per_second_per_gpu: float, preset: Preset, seq_length: int, peak_flops: float) -> float:
    """Model FLOPs utilisation: achieved model FLOP/s per GPU over the GPU's peak FLOP/s."""
    return tokens_per_second_per_gpu * train_flops_per_token(preset, seq_length) / peak_flops
