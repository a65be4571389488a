"""The multi-token-prediction head of a released Qwen3.5 checkpoint, for tests. transformers has no MTP module (its
Qwen3.5 models ignore ``mtp.*`` on load), so the head is assembled under the names vLLM's Qwen3.5 MTP drafter loads
(``vllm/model_executor/models/qwen3_5_mtp.py``): ``fc`` ``[hidden, 2 * hidden]``, the norms ``pre_fc_norm_embedding``,
``pre_fc_norm_hidden`` and ``norm``, and ``layers.0``, a gated-attention decoder layer built by transformers
(``Qwen3_5DecoderLayer``), so that the layer's names and shapes come from transformers, not from this project."""

import torch

MTP = "mtp."


def hf_mtp_tensors(preset, seed: int = 0) -> dict[str, torch.Tensor]:
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5DecoderLayer

    generator = torch.Generator().manual_seed(seed)
    h = preset.hidden_size
    layer = Qwen3_5DecoderLayer(preset.family.hf_config(preset), preset.layer_types().index("full_attention"))
    shapes = {f"{MTP}fc.weight": (h, 2 * h), **{f"{MTP}{n}.weight": (h,) for n in
                                                 ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm")},
              **{f"{MTP}layers.0.{k}": tuple(v.shape) for k, v in layer.state_dict().items()}}
    return {name: torch.randn(shape, generator=generator) for name, shape in shapes.items()}
