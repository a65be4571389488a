"""Episode rewards. Importing the package registers every reward, so ``rewards_for`` sees them all."""

from megatron_mimesis.rl.rewards import behaviour, verifiable
from megatron_mimesis.rl.rewards.registry import Reward, RewardResult, get_reward, register, rewards_for

__all__ = ["Reward", "RewardResult", "behaviour", "get_reward", "register", "rewards_for", "verifiable"]
