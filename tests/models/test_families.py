"""The registry of model families: presets found by name, by a checkpoint's record and by an HF config's
model_type; each family's HF config both ways; a checkpoint of an unsupported family or layout refused in one line
naming the field."""

import pytest

from megatron_mimesis.models.presets import (
    FAMILIES,
    PRESETS,
    TINY_PRESETS,
    architecture_differences,
    get_preset,
    preset_from_hf_config,
    preset_from_hf_dir,
    preset_from_record,
    preset_record,
)


def test_every_preset_names_its_family_and_each_family_has_a_tiny_twin():
    assert {p.family.name for p in PRESETS.values()} == set(FAMILIES) == {"qwen3_5", "qwen3"}
    assert TINY_PRESETS == ("tiny", "qwen3-tiny")
    assert all(name == preset.name for name, preset in PRESETS.items())


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_the_hf_config_reads_back_as_the_same_preset(name):
    preset = get_preset(name)
    back = preset_from_hf_config(preset.family.hf_config(preset), name=name)
    assert architecture_differences(preset, back) == []  # the HF config of the text model carries no MTP layer
    assert preset_from_record(preset_record(preset)) == preset


def test_a_record_without_a_family_is_the_first_familys_and_an_unknown_one_is_refused():
    record = preset_record(get_preset("9b"))
    del record["family"]  # as checkpoints saved before families existed recorded it
    assert preset_from_record(record) == get_preset("9b")
    with pytest.raises(ValueError, match=r"^ckpt/run_config.json: preset of unknown family 'llama'"):
        preset_from_record({**record, "family": "llama"}, "ckpt/run_config.json")
    with pytest.raises(ValueError, match=r"preset fields \['linear_num_key_heads'\] are not Qwen3's"):
        preset_from_record({**preset_record(get_preset("qwen3-tiny")), "linear_num_key_heads": 2})


@pytest.mark.parametrize(("changes", "field"), [
    ({"use_sliding_window": True}, "use_sliding_window"),
    ({"attention_bias": True}, "attention_bias"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0,
                          "original_max_position_embeddings": 32768}}, "rope_parameters.rope_type"),
])
def test_a_qwen3_layout_the_model_layer_does_not_build_is_refused_naming_the_field(tmp_path, changes, field):
    preset = get_preset("qwen3-tiny")
    config = preset.family.hf_config(preset, **changes)
    config.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=rf"^{tmp_path}/config.json: {field}: "):
        preset_from_hf_dir(tmp_path)


def test_an_hf_config_of_another_family_is_refused_naming_its_model_type(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "llama", "hidden_size": 64}')
    with pytest.raises(ValueError, match=r"config.json: model_type 'llama' is not a supported family \(supported: "
                                         r"\['qwen3', 'qwen3_5', 'qwen3_5_text'\]\)"):
        preset_from_hf_dir(tmp_path)


def test_architecture_differences_name_the_family_first_then_each_field():
    assert architecture_differences(get_preset("tiny"), get_preset("qwen3-tiny")) == ["family: Qwen3.5 vs Qwen3"]
    assert architecture_differences(get_preset("qwen3-8b"), get_preset("qwen3-4b"))[:2] == [
        "hidden_size: 4096 vs 2560", "ffn_hidden_size: 12288 vs 9728"]
    assert architecture_differences(get_preset("9b"), get_preset("9b").replace(name="x", mtp_num_layers=0)) == []
