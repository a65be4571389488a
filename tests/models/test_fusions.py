"""Which megatron-core fusions a run gets: each exactly where the code it selects can run, all off on the CPU."""

from megatron_mimesis.models.config import fusion_flags, installed_fusions, transformer_config
from megatron_mimesis.models.presets import get_preset

FUSIONS = ("bias_activation_fusion", "bias_dropout_fusion", "apply_rope_fusion", "gradient_accumulation_fusion",
           "masked_softmax_fusion", "persist_layer_norm")


def test_each_fusion_follows_what_its_code_needs():
    assert set(fusion_flags(cuda=True, te=True, apex=True)) == set(FUSIONS)
    assert not any(fusion_flags(cuda=False, te=True, apex=True).values())  # the CPU path: every flag off
    gpu_with_te = fusion_flags(cuda=True, te=True, apex=False)  # the [gpu] extra without apex's extensions
    assert {name for name, on in gpu_with_te.items() if on} == {"bias_activation_fusion", "bias_dropout_fusion",
                                                                "apply_rope_fusion"}
    assert not fusion_flags(cuda=True, te=False, apex=False)["apply_rope_fusion"]  # TE's fused RoPE
    with_apex = fusion_flags(cuda=True, te=True, apex=True)
    assert with_apex["gradient_accumulation_fusion"] and with_apex["masked_softmax_fusion"]
    assert not with_apex["persist_layer_norm"]  # apex's LayerNorm kernel: an RMSNorm model never runs it


def test_this_cpu_run_builds_with_no_fusion():
    assert not any(installed_fusions().values())
    config = transformer_config(get_preset("tiny"))
    assert not any(getattr(config, name) for name in FUSIONS)
