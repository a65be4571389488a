"""Qwen3.5 (4B, 9B and the CPU-sized twin): presets, megatron config and layer specs, the HF mapping."""

from megatron_mimesis.models.qwen3_5.family import Qwen35Family

FAMILY = Qwen35Family()
