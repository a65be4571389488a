"""Independent check against Liger-Kernel's GRPO losses on cases where the definitions coincide.

Liger's Triton ``triton_grpo_loss`` runs on CPU under the Triton interpreter. Its ``loss_type="bnpo"`` is our
"token-mean" (sum of masked per-token losses over this batch's mask sum); its ``loss_type="grpo"`` is our
"seq-mean-token-mean" except that Liger divides by the number of sequences *including* ones without loss tokens
(ours counts only sequences with loss tokens), so the cases below give every sequence a loss token. Liger's
``delta`` is our ``ratio_upper_clamp``, its ``is_clipped`` metric our clip_frac_low + clip_frac_high, and it takes
per-sequence advantages ([B]) and logits [B, L + 1, V] of which the last position is unused.
"""

import pytest
import torch
from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss
from liger_kernel.transformers.grpo_loss import triton_grpo_loss
from megatron_mimesis.kernels import fused_linear_policy_loss, policy_loss_from_logits

from .helpers import FORWARD_ATOL, GRAD_REL, assert_close_to_scale

B, L, V, H = 3, 7, 50, 16


def _batch(seed):
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (B, L), generator=generator)
    mask = torch.ones(B, L, dtype=torch.long)
    mask[1, 4:] = 0
    mask[2, :2] = 0
    advantages = torch.randn(B, generator=generator)
    return generator, ids, mask, advantages


@pytest.mark.parametrize(("loss_type", "loss_agg", "delta"),
                         [("bnpo", "token-mean", None), ("grpo", "seq-mean-token-mean", 1.5)])
def test_matches_liger_triton_grpo_loss(loss_type, loss_agg, delta):
    generator, ids, mask, advantages = _batch(0)
    logits = (2 * torch.randn(B, L + 1, V, generator=generator)).requires_grad_()
    with torch.no_grad():
        current = torch.log_softmax(logits[:, :L], -1).gather(-1, ids[..., None])[..., 0]
    old = current + 0.4 * torch.randn(B, L, generator=generator)
    liger_loss, liger_metrics = triton_grpo_loss(logits, old, None, ids, advantages, mask, temperature=1.0,
                                                 beta=0.0, eps_low=0.2, eps_high=0.28, inplace=False,
                                                 loss_type=loss_type, reduce=True, delta=delta)
    (liger_grad,) = torch.autograd.grad(liger_loss, logits)

    flat_logits = logits.detach()[:, :L].reshape(B * L, V).requires_grad_()
    loss, metrics = policy_loss_from_logits(flat_logits, ids.reshape(-1), mask.reshape(-1), old.reshape(-1),
                                            advantages.repeat_interleave(L), clip_eps_low=0.2, clip_eps_high=0.28,
                                            ratio_upper_clamp=delta, loss_agg=loss_agg,
                                            cu_seqlens=torch.arange(B + 1) * L, impl="triton")
    (grad,) = torch.autograd.grad(loss, flat_logits)
    torch.testing.assert_close(loss, liger_loss, rtol=0, atol=FORWARD_ATOL)
    clip_frac = metrics["clip_frac_low"] + metrics["clip_frac_high"]
    torch.testing.assert_close(clip_frac, liger_metrics[-1], rtol=0, atol=FORWARD_ATOL)
    assert clip_frac > 0
    assert_close_to_scale(grad, liger_grad[:, :L].reshape(B * L, V), GRAD_REL[torch.float32])
    assert (liger_grad[:, L] == 0).all()


def test_matches_liger_fused_linear_grpo_loss():
    generator, ids, mask, advantages = _batch(1)
    hidden = torch.randn(B, L, H, generator=generator)
    weight = torch.randn(V, H, generator=generator) / H**0.5
    with torch.no_grad():
        current = torch.log_softmax(hidden @ weight.t(), -1).gather(-1, ids[..., None])[..., 0]
    old = current + 0.4 * torch.randn(B, L, generator=generator)
    liger = LigerFusedLinearGRPOLoss(beta=0.0, compiled=False, use_ref_model=False, loss_type="bnpo",
                                     epsilon_low=0.2, epsilon_high=0.2, temperature=1.0)
    liger_inputs = (hidden.clone().requires_grad_(), weight.clone().requires_grad_())
    liger_loss, _ = liger(*liger_inputs, ids, mask, advantages, old_per_token_logps=old)
    liger_grads = torch.autograd.grad(liger_loss, liger_inputs)

    inputs = (hidden.reshape(B * L, H).clone().requires_grad_(), weight.clone().requires_grad_())
    loss, _ = fused_linear_policy_loss(*inputs, ids.reshape(-1), mask.reshape(-1), old.reshape(-1),
                                       advantages.repeat_interleave(L), impl="triton")
    grads = torch.autograd.grad(loss, inputs)
    torch.testing.assert_close(loss, liger_loss, rtol=0, atol=FORWARD_ATOL)
    assert_close_to_scale(grads[0], liger_grads[0].reshape(B * L, H), GRAD_REL[torch.float32])
    assert_close_to_scale(grads[1], liger_grads[1], GRAD_REL[torch.float32])
