"""The two RL stages on megatron-core. Entry points: ``simulator_rl.py`` (stage I, FoldGRPO) and ``agent_rl.py``
(stage II, GRPO + CSD), each its loop top to bottom; ``loop.py`` is what they share around their step, ``config.py``
the options they share, ``types.py`` the records that flow between the rooms:

- ``engines/``  what samples the tokens (local, vLLM colocated, transformers, an endpoint) and the weight sync;
- ``envs/``     agent-RL environments (tau2 domains, the toy env);
- ``rewards/``  simulator-RL rewards (verifiable, the behaviour judge);
- ``simulator/``, ``agent/``  each stage's episode machinery and config;
- ``update/``   the trainer's side of a step: scoring rows and the policy-gradient update.
"""
