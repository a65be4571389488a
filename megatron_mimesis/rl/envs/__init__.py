"""Agent-RL environments by name: the toy env (CPU tests, the demo) and tau2 domains (the ``[envs]`` extra)."""

ENVS = ("toy", "tau2")


def build_suite(env: str, options: dict):
    """The ``EnvSuite`` for ``env`` with its keyword ``options`` (tau2: {"domain": ..., "evaluation": ...})."""
    if env == "toy":
        from megatron_mimesis.rl.envs.toy import ToySuite

        return ToySuite(**options)
    if env == "tau2":
        from megatron_mimesis.rl.envs.tau2 import Tau2Suite

        return Tau2Suite(**options)
    raise ValueError(f"env must be one of {ENVS}, not {env!r}")
