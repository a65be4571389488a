"""HF <-> Megatron mappings of every family: bit-exact round trips and the per-rank layouts spelled out by hand."""

import pytest
import torch

from megatron_mimesis.models.config import padded_vocab_size
from megatron_mimesis.models.mapping import hf_to_megatron, localize_layer_names, megatron_to_hf
from megatron_mimesis.models.presets import get_preset
from megatron_mimesis.models.qwen3_5.mapping import qwen35_mapping
from tests.models.hf_mtp import hf_mtp_tensors

# The real 9B head layout (16 q / 4 kv heads; DeltaNet 16 k / 32 v heads) with small widths.
NINE_B_SHAPED = get_preset("9b").replace(
    vocab_size=1000, hidden_size=32, ffn_hidden_size=48, num_layers=4, head_dim=4,
    linear_key_head_dim=4, linear_value_head_dim=4,
)
# Qwen3-8B's head layout (32 q / 8 kv heads) with small widths.
QWEN3_8B_SHAPED = get_preset("qwen3-8b").replace(vocab_size=1000, hidden_size=32, ffn_hidden_size=48, num_layers=2,
                                                 head_dim=4)


def _random_hf_state(preset):
    """Random tensors in every HF slot; the plain (not zero-centred) DeltaNet norm gains around 1 as trained ones."""
    torch.manual_seed(0)
    model = preset.family.hf_model(preset)
    state = {k: torch.randn_like(v) for k, v in model.state_dict().items()}
    for k in state:
        if k.endswith("linear_attn.norm.weight"):
            state[k] = (1.0 + 0.2 * state[k]).clamp(0.5, 2.0)
    if getattr(preset, "mtp_num_layers", 0):
        state |= hf_mtp_tensors(preset)
    return state


@pytest.mark.parametrize("preset", [
    get_preset("tiny"), NINE_B_SHAPED, get_preset("tiny").replace(tie_word_embeddings=True),
    get_preset("qwen3-tiny"), QWEN3_8B_SHAPED, get_preset("qwen3-tiny").replace(tie_word_embeddings=True),
], ids=["tiny", "9b-shaped", "tiny-tied", "qwen3-tiny", "qwen3-8b-shaped", "qwen3-tiny-tied"])
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_round_trip_is_bit_exact(preset, tp):
    if preset.num_query_groups % tp:
        pytest.skip("TP must divide the query groups")
    hf = _random_hf_state(preset)
    if preset.tie_word_embeddings:
        hf.pop("lm_head.weight", None)  # tied: HF checkpoints store only the embedding
    table = preset.family.mapping(preset, padded_vocab_size(preset.vocab_size, tp))
    shards = hf_to_megatron(hf, table, tp)
    back = megatron_to_hf(shards, table)
    assert set(back) == set(hf), set(hf) ^ set(back)
    for name, tensor in hf.items():
        assert torch.equal(back[name], tensor), name


def test_vocab_is_padded_with_zero_rows_and_split():
    preset = NINE_B_SHAPED  # vocab 1000 -> padded to 1024 at TP=2 (multiple of 64 * 2)
    hf = _random_hf_state(preset)
    table = qwen35_mapping(preset, padded_vocab_size(preset.vocab_size, 2))
    r0, r1 = hf_to_megatron(hf, table, 2)
    emb = hf["model.embed_tokens.weight"]
    assert r0["embedding.word_embeddings.weight"].shape == (512, 32)
    assert torch.equal(r0["embedding.word_embeddings.weight"], emb[:512])
    assert torch.equal(r1["embedding.word_embeddings.weight"][:488], emb[512:])
    assert torch.count_nonzero(r1["embedding.word_embeddings.weight"][488:]) == 0


def test_gated_attention_layout_per_query_group():
    """Rank r holds whole query groups, each as [q heads, gate heads, k, v]; HF q_proj is per head [q; gate]."""
    p = NINE_B_SHAPED  # 16 heads in 4 groups of 4, head_dim 4
    hf = _random_hf_state(p)
    table = qwen35_mapping(p, padded_vocab_size(p.vocab_size, 2))
    shards = hf_to_megatron(hf, table, 2)
    a = "model.layers.3.self_attn."
    q_proj, k_proj, v_proj = hf[a + "q_proj.weight"], hf[a + "k_proj.weight"], hf[a + "v_proj.weight"]
    d = p.head_dim
    head = lambda h: q_proj[2 * d * h: 2 * d * h + d]  # noqa: E731
    gate = lambda h: q_proj[2 * d * h + d: 2 * d * (h + 1)]  # noqa: E731
    # rank 1, its first group = global group 2 = heads 8..11, kv head 2
    expected = torch.cat([*(head(h) for h in range(8, 12)), *(gate(h) for h in range(8, 12)),
                          k_proj[2 * d: 3 * d], v_proj[2 * d: 3 * d]])
    got = shards[1]["decoder.layers.3.self_attention.linear_qkv.weight"]
    assert got.shape[0] == 2 * (4 + 4 + 1 + 1) * d
    assert torch.equal(got[: expected.shape[0]], expected)


def test_qwen3_attention_layout_per_query_group():
    """Without an output gate each group is [q heads, k, v]: Qwen3's q_proj is the heads one after another."""
    p = QWEN3_8B_SHAPED  # 32 heads in 8 groups of 4, head_dim 4
    hf = _random_hf_state(p)
    table = p.family.mapping(p, padded_vocab_size(p.vocab_size, 2))
    shards = hf_to_megatron(hf, table, 2)
    a = "model.layers.1.self_attn."
    q_proj, k_proj, v_proj = hf[a + "q_proj.weight"], hf[a + "k_proj.weight"], hf[a + "v_proj.weight"]
    d = p.head_dim
    # rank 1, its second group = global group 5 = heads 20..23, kv head 5
    expected = torch.cat([q_proj[20 * d: 24 * d], k_proj[5 * d: 6 * d], v_proj[5 * d: 6 * d]])
    got = shards[1]["decoder.layers.1.self_attention.linear_qkv.weight"]
    assert got.shape[0] == 4 * (4 + 1 + 1) * d
    assert torch.equal(got[6 * d: 12 * d], expected)
    # plain norm gains move unchanged (no zero-centring shift on either side)
    assert torch.equal(shards[0]["decoder.layers.1.self_attention.q_layernorm.weight"], hf[a + "q_norm.weight"])
    assert torch.equal(shards[0]["decoder.layers.1.mlp.linear_fc1.layer_norm_weight"],
                       hf["model.layers.1.post_attention_layernorm.weight"])


def test_gated_deltanet_in_proj_is_split_per_part_then_concatenated():
    p = NINE_B_SHAPED  # key dim 16*4=64, value dim 32*4=128, 32 value heads
    hf = _random_hf_state(p)
    table = qwen35_mapping(p, padded_vocab_size(p.vocab_size, 2))
    r1 = hf_to_megatron(hf, table, 2)[1]
    a = "model.layers.0.linear_attn."
    qkv = hf[a + "in_proj_qkv.weight"]
    expected = torch.cat([
        qkv[32:64],            # q, second half of the 16 key heads
        qkv[64 + 32: 128],     # k, second half
        qkv[128 + 64: 256],    # v, second half of the 32 value heads
        hf[a + "in_proj_z.weight"][64:],
        hf[a + "in_proj_b.weight"][16:],
        hf[a + "in_proj_a.weight"][16:],
    ])
    assert torch.equal(r1["decoder.layers.0.self_attention.in_proj.weight"], expected)
    conv = hf[a + "conv1d.weight"]
    assert torch.equal(r1["decoder.layers.0.self_attention.conv1d.weight"],
                       torch.cat([conv[32:64], conv[96:128], conv[192:256]]))
    assert torch.equal(r1["decoder.layers.0.self_attention.A_log"], hf[a + "A_log"][16:])


def test_deltanet_output_norm_is_shifted_to_zero_centred():
    p = get_preset("tiny")
    hf = _random_hf_state(p)
    table = qwen35_mapping(p, padded_vocab_size(p.vocab_size, 1))
    (r0,) = hf_to_megatron(hf, table, 1)
    w = hf["model.layers.1.linear_attn.norm.weight"]
    assert torch.equal(r0["decoder.layers.1.self_attention.out_norm.weight"], w - 1.0)
    # decoder norms are zero-centred on both sides: unchanged
    assert torch.equal(r0["decoder.layers.1.mlp.linear_fc1.layer_norm_weight"],
                       hf["model.layers.1.post_attention_layernorm.weight"])


def test_shifted_norm_outside_sterbenz_range_is_within_one_ulp():
    p = get_preset("tiny")
    hf = _random_hf_state(p)
    name = "model.layers.0.linear_attn.norm.weight"
    hf[name] = torch.tensor([1e-3, -3.0, 7.5, 0.1] * 4)
    table = qwen35_mapping(p, padded_vocab_size(p.vocab_size, 1))
    back = megatron_to_hf(hf_to_megatron(hf, table, 1), table)[name]
    assert torch.allclose(back, hf[name], rtol=0, atol=torch.finfo(torch.float32).eps * 8)


@pytest.mark.parametrize(("tied", "untied"), [("4b", "9b"), ("qwen3-4b", "qwen3-8b")])
def test_tied_preset_has_no_lm_head_entry(tied, untied):
    def names(preset):
        return {m.megatron for m in preset.family.mapping(preset, 248320)}

    assert "output_layer.weight" not in names(get_preset(tied))
    assert "output_layer.weight" in names(get_preset(untied))


def test_localize_layer_names_for_second_stage():
    got = localize_layer_names(["decoder.layers.2.mlp.linear_fc2.weight", "output_layer.weight"], offset=2)
    assert got == {"decoder.layers.2.mlp.linear_fc2.weight": "decoder.layers.0.mlp.linear_fc2.weight",
                   "output_layer.weight": "output_layer.weight"}
