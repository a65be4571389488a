"""Agent-RL environments by name: the toy env (CPU tests, the demo), tau2 domains (the ``[envs]`` extra) and UserRL's
gyms (installed from UserRL's sources; their envs own their user)."""

ENVS = ("toy", "tau2", "userrl")


def build_suite(env: str, options: dict):
    """The ``EnvSuite`` for ``env`` with its keyword ``options`` (tau2: {"domain": ..., "evaluation": ...}; userrl:
    {"gyms": {...}, ...}, ``envs/userrl.py``)."""
    if env == "toy":
        from megatron_mimesis.rl.envs.toy import ToySuite

        return ToySuite(**options)
    if env == "tau2":
        from megatron_mimesis.rl.envs.tau2 import Tau2Suite

        return Tau2Suite(**options)
    if env == "userrl":
        from megatron_mimesis.rl.envs.userrl import UserRLSuite

        return UserRLSuite(**options)
    raise ValueError(f"env must be one of {ENVS}, not {env!r}")
