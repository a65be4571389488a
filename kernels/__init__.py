"""Fused Triton loss kernels, imported as ``megatron_mimesis.kernels``."""
