"""Agent RL's episode machinery (stage II, the loop is ``rl/agent_rl.py``): the frozen user simulator, the agent's
episodes with tool calls, reward-to-go rows, coached self-distillation (coach, teacher contexts) and the config."""
