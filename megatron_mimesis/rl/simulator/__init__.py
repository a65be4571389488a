"""Simulator RL's episode machinery (stage I, the loop is ``rl/simulator_rl.py``): the prompts by domain, the
counterpart the simulator talks to, the multi-turn episodes and their folding into FoldGRPO rows, the config."""
