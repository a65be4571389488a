"""Fused Triton loss kernels, imported as ``megatron_mimesis.kernels``.

Every kernel has a plain-PyTorch reference (reference.py) selectable with ``impl="torch"``; ``impl="auto"`` uses
Triton on CUDA tensors and falls back to the reference elsewhere.
"""

from .cross_entropy import fused_linear_cross_entropy, fused_linear_logprobs
from .group_stats import discounted_returns, foldgrpo_advantages, turn_credit_advantages
from .policy_loss import fused_linear_policy_loss, policy_loss_from_logits

__all__ = [
    "discounted_returns",
    "foldgrpo_advantages",
    "fused_linear_cross_entropy",
    "fused_linear_logprobs",
    "fused_linear_policy_loss",
    "policy_loss_from_logits",
    "turn_credit_advantages",
]
