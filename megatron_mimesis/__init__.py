"""The MIMESIS recipe (user simulators and the agents trained against them) on megatron-core."""

__version__ = "0.1.0"
