"""Qwen3 dense models (0.6B to 14B and the CPU-sized twin): presets, megatron config and layer specs, the HF mapping.
The paper's agent is Qwen3-8B."""

from megatron_mimesis.models.qwen3.family import Qwen3Family

FAMILY = Qwen3Family()
