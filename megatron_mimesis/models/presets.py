"""The registry of model families and their presets: how anything outside the model layer finds a family.

A run from scratch names a preset (``model: qwen3-8b``); a checkpoint records its preset with the family it belongs
to (:func:`preset_record`, read back by :func:`preset_from_record`); an HF directory says its family by the
``model_type`` of its config. Preset names are unique across families.
"""

import dataclasses

from megatron_mimesis.models.family import ModelFamily, Preset
from megatron_mimesis.models.qwen3 import FAMILY as QWEN3
from megatron_mimesis.models.qwen3_5 import FAMILY as QWEN3_5

FAMILIES: dict[str, ModelFamily] = {family.name: family for family in (QWEN3_5, QWEN3)}
# A record saved before families existed is Qwen3.5's, the one family there was.
FIRST_FAMILY = QWEN3_5.name
FAMILY_KEY = "family"


def _all_presets() -> dict[str, Preset]:
    presets: dict[str, Preset] = {}
    for family in FAMILIES.values():
        clash = set(presets) & set(family.presets)
        if clash:
            raise RuntimeError(f"preset names {sorted(clash)} are defined by two families")
        presets.update(family.presets)
    return presets


PRESETS: dict[str, Preset] = _all_presets()
# the CPU-sized twins: the only models the engines without a KV cache may decode
TINY_PRESETS = tuple(family.tiny_preset for family in FAMILIES.values())


def get_preset(name: str) -> Preset:
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown model preset {name!r}; choose one of {sorted(PRESETS)}") from None


def preset_record(preset: Preset) -> dict:
    """What a checkpoint's run_config.json keeps of its model: the family and every preset field."""
    return {FAMILY_KEY: preset.family_name, **dataclasses.asdict(preset)}


def preset_from_record(record: dict, source: str = "run_config.json") -> Preset:
    """The preset a checkpoint recorded (one saved before families existed is Qwen3.5's)."""
    fields = dict(record)
    family = fields.pop(FAMILY_KEY, FIRST_FAMILY)
    if family not in FAMILIES:
        raise ValueError(f"{source}: preset of unknown family {family!r}; this version knows {sorted(FAMILIES)}")
    cls = type(next(iter(FAMILIES[family].presets.values())))
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(fields) - known)
    if unknown:
        raise ValueError(f"{source}: preset fields {unknown} are not {FAMILIES[family].title}'s")
    return cls(**fields)


def family_of_model_type(model_type, source: str) -> ModelFamily:
    """The family an HF config's ``model_type`` belongs to; a one-line error naming the field otherwise."""
    for family in FAMILIES.values():
        if model_type in family.hf_model_types:
            return family
    known = sorted(t for family in FAMILIES.values() for t in family.hf_model_types)
    raise ValueError(f"{source}: model_type {model_type!r} is not a supported family (supported: {known})")


def preset_from_hf_config(hf_config, name: str = "hf", source: str = "config.json") -> Preset:
    """The preset of a transformers config, by its ``model_type``; a one-line ValueError (naming ``source`` and the
    field) for an unsupported family or layout."""
    family = family_of_model_type(getattr(hf_config, "model_type", None), source)
    try:
        return family.preset_from_hf_config(hf_config, name)
    except ValueError as exc:
        raise ValueError(f"{source}: {exc}") from None


def preset_from_hf_dir(directory, name: str | None = None) -> Preset:
    """The preset of an HF checkpoint directory: the family by its ``config.json``'s ``model_type`` (a composite
    config's text part is the family's to read), then the sizes by transformers' config of that family."""
    import json
    from pathlib import Path

    from transformers import AutoConfig

    directory = Path(directory)
    config_path = directory / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"{config_path}: missing (an HF checkpoint directory has one)")
    try:
        model_type = json.loads(config_path.read_text()).get("model_type")
    except (json.JSONDecodeError, AttributeError):
        raise ValueError(f"{config_path}: not a JSON object") from None
    family_of_model_type(model_type, str(config_path))
    return preset_from_hf_config(AutoConfig.from_pretrained(directory), name or directory.name, source=str(config_path))


# What two presets may differ in and still be the same model: the name, the longest position the run uses, and the
# MTP layers no stage trains.
NOT_ARCHITECTURE = ("name", "max_position_embeddings", "mtp_num_layers")


def architecture_differences(expected: Preset, found: Preset) -> list[str]:
    """``field: expected vs found`` for every architectural difference (the family first), empty for the same model."""
    if expected.family is not found.family:
        return [f"family: {expected.family.title} vs {found.family.title}"]
    return [f"{f.name}: {getattr(expected, f.name)!r} vs {getattr(found, f.name)!r}"
            for f in dataclasses.fields(expected)
            if f.name not in NOT_ARCHITECTURE and getattr(expected, f.name) != getattr(found, f.name)]
