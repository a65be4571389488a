"""Model FLOPs per token of the Qwen3.5 hybrid stack, for MFU.

MFU compares the FLOPs the *model* needs per token with the GPU's peak, so recomputation is not counted
(PaLM's definition; the trainer may do more work than this). Element-wise work (norms, RoPE, SwiGLU, gates,
softmax) is left out; only matrix products are counted, at 2 FLOPs per multiply-add.

Forward FLOPs per token (L layers, 1 in 4 full attention, the rest Gated DeltaNet):

* dense projections, 2 x (weight elements) each:
  full attention q+gate / k / v / o:  h*(2*H*d) + 2 * h*(G*d) + (H*d)*h
  DeltaNet in_proj_qkv / z / b / a:   h*(2*Hk*dk + Hv*dv) + h*(Hv*dv) + 2 * h*Hv,   out_proj: (Hv*dv)*h
  DeltaNet depthwise causal conv:     (2*Hk*dk + Hv*dv) * conv_kernel (as 2 x its weight elements)
  SwiGLU MLP:                          3 * h*f
  LM head:                             h*V (counted even when tied to the embedding; the lookup is free)
* causal attention scores and values on the full-attention layers: QK^T and AV each cost 2*S*H*d per token
  for a full row, and a causal row sees S/2 keys on average: 2*2*S*H*d/2 = 2*S*H*d per token and layer.
* the chunked gated delta rule (flash-linear-attention's ``chunk_gated_delta_rule``, chunk C = 64), per value
  head and token; queries and keys are repeated to the Hv value heads before the kernel, as megatron-core
  does, so every term runs per value head with dk x dv state:
  intra-chunk  K K^T (2*C*dk), W = T (beta K) (2*C*dk), Q K^T (2*C*dk), U = T (beta V) (2*C*dv),
               (Q K^T) V_new (2*C*dv), the triangular solve for T (~C^2)  -> 2*C*(3*dk + 2*dv) + C^2
  inter-chunk  V_new = U - W S, O += Q S, S += K^T V_new, each 2*dk*dv      -> 6*dk*dv
  (state decay and gating are element-wise and dropped). For the 9B model this is ~1% of the forward.

Training = 3 x forward (backward computes gradients of activations and of weights, 1x forward each). The
MTP layer is not trained by our stages and not counted.

Check against the issue's ~5.8e10 FLOPs per token for 9B at length 24576: this module gives 5.29e10 for
training (1.76e10 forward). The issue's figure is what the common 6*N shortcut gives with N = all 8.95e9
parameters (6*N = 5.37e10) plus causal attention (0.48e10): 5.85e10. That N includes the 1.02e9-parameter
input embedding, a table lookup that does no matrix product (6*V*h = 0.61e10 of the gap); the remaining
+0.04e10 on our side is the DeltaNet recurrence, which 6*N does not see. At the paper's
717 tokens/s/GPU on A100 this gives 12.2% MFU, the ~12% quoted in DESIGN.md.
"""

from megatron_mimesis.models.presets import Qwen35Preset

DELTANET_CHUNK_SIZE = 64  # flash-linear-attention's chunk length for chunk_gated_delta_rule

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


def _attention_matmul_params(p: Qwen35Preset) -> int:
    q_and_gate = 2 * p.num_attention_heads * p.head_dim
    kv = 2 * p.num_query_groups * p.head_dim
    return p.hidden_size * (q_and_gate + kv) + p.num_attention_heads * p.head_dim * p.hidden_size


def _deltanet_matmul_params(p: Qwen35Preset) -> int:
    key_dim = p.linear_num_key_heads * p.linear_key_head_dim
    value_dim = p.linear_num_value_heads * p.linear_value_head_dim
    conv_dim = 2 * key_dim + value_dim
    in_proj = p.hidden_size * (conv_dim + value_dim + 2 * p.linear_num_value_heads)
    return in_proj + value_dim * p.hidden_size + conv_dim * p.linear_conv_kernel_dim


def _mlp_params(p: Qwen35Preset) -> int:
    return 3 * p.hidden_size * p.ffn_hidden_size


def causal_attention_flops(p: Qwen35Preset, seq_length: int) -> float:
    """Forward QK^T + AV FLOPs per token of one full-attention layer, averaged over a causal row."""
    return 2 * 2 * seq_length * p.num_attention_heads * p.head_dim / 2


def deltanet_recurrence_flops(p: Qwen35Preset, chunk_size: int = DELTANET_CHUNK_SIZE) -> float:
    """Forward FLOPs per token of the chunked gated delta rule in one DeltaNet layer (see module docstring)."""
    dk, dv, c = p.linear_key_head_dim, p.linear_value_head_dim, chunk_size
    per_head = 2 * c * (3 * dk + 2 * dv) + c * c + 6 * dk * dv
    return p.linear_num_value_heads * per_head


def _matmul_params(preset: Qwen35Preset) -> int:
    """Parameters that multiply every token: the layers' projections and the output layer."""
    layer_types = preset.layer_types()
    n_attention = layer_types.count("full_attention")
    return (
        n_attention * _attention_matmul_params(preset)
        + (len(layer_types) - n_attention) * _deltanet_matmul_params(preset)
        + preset.num_layers * _mlp_params(preset)
        + preset.hidden_size * preset.vocab_size
    )


def parameter_count(preset: Qwen35Preset) -> int:
    """Trained parameters, up to norms and biases (<0.1%): the matmul weights plus an untied input embedding."""
    return _matmul_params(preset) + (0 if preset.tie_word_embeddings else preset.hidden_size * preset.vocab_size)


def model_flops_per_token(preset: Qwen35Preset, seq_length: int) -> float:
    """Forward FLOPs per token at a packed row length of ``seq_length``."""
    layer_types = preset.layer_types()
    n_attention = layer_types.count("full_attention")
    n_deltanet = len(layer_types) - n_attention
    return (
        2.0 * _matmul_params(preset)
        + n_attention * causal_attention_flops(preset, seq_length)
        + n_deltanet * deltanet_recurrence_flops(preset)
    )


def train_flops_per_token(preset: Qwen35Preset, seq_length: int) -> float:
    """Forward + backward FLOPs per token (3 x forward), the numerator of MFU."""
    return 3.0 * model_flops_per_token(preset, seq_length)


def mfu(tokens_per_second_per_gpu: float, preset: Qwen35Preset, seq_length: int, peak_flops: float) -> float:
    """Model FLOPs utilisation: achieved model FLOP/s per GPU over the GPU's peak FLOP/s."""
    return tokens_per_second_per_gpu * train_flops_per_token(preset, seq_length) / peak_flops
