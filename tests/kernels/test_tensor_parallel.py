"""Vocab-sharded (TP=2, gloo) losses equal the TP=1 result: loss, metrics, entropy, grad_h (summed over the
group inside the kernel's backward) and each rank's grad_W shard."""

import pytest
import torch
import torch.distributed as dist
from megatron_mimesis.kernels import fused_linear_cross_entropy, fused_linear_policy_loss, policy_loss_from_logits

from tests.multiproc import run_distributed

from .helpers import FORWARD_ATOL, GRAD_REL, assert_close_to_scale, random_problem

N, V, H = 40, 150, 24  # 75 vocab rows per rank: not a multiple of the 32-wide interpreter tile
CU_SEQLENS = torch.tensor([0, 9, 17, 30, 40])


def _problem():
    hidden, weight, targets = random_problem(N, V, H, torch.float32, seed=7)
    generator = torch.Generator().manual_seed(8)
    with torch.no_grad():
        current = torch.log_softmax(hidden @ weight.t(), -1).gather(1, targets[:, None])[:, 0]
    mask = (torch.rand(N, generator=generator) > 0.2).long()
    old = current + 0.3 * torch.randn(N, generator=generator)
    advantages = torch.randn(N, generator=generator)
    teacher = current + torch.randn(N, generator=generator)
    return hidden, weight, targets, mask, old, advantages, teacher


def _losses(hidden, weight, tp_group, impl):
    """Policy loss from hidden, from logits, and cross entropy, each with its gradients."""
    _, _, targets, mask, old, advantages, teacher = _problem()
    results = {}
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    loss, metrics = fused_linear_policy_loss(h, w, targets, mask, old, advantages, teacher_logprobs=teacher,
                                             csd_alpha=0.3, loss_agg="seq-mean-token-mean", cu_seqlens=CU_SEQLENS,
                                             return_entropy=True, tp_group=tp_group, impl=impl)
    results["policy"] = (loss.detach(), metrics, *torch.autograd.grad(loss, (h, w)))
    logits = (hidden @ weight.t()).requires_grad_()
    loss, metrics = policy_loss_from_logits(logits, targets, mask, old, advantages, teacher_logprobs=teacher,
                                            csd_alpha=0.3, return_entropy=True, tp_group=tp_group, impl=impl)
    results["logits"] = (loss.detach(), metrics, *torch.autograd.grad(loss, logits))
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    loss, metrics = fused_linear_cross_entropy(h, w, targets, mask, tp_group=tp_group, impl=impl)
    results["cross_entropy"] = (loss.detach(), metrics, *torch.autograd.grad(loss, (h, w)))
    return results


def _tp_rank(rank, world_size, impl):
    hidden, weight, *_ = _problem()
    shard = weight.chunk(world_size)[rank].contiguous()
    results = _losses(hidden, shard, dist.group.WORLD, impl)
    dist.barrier()  # both ranks done with collectives before either tears the group down
    return results


@pytest.mark.slow
@pytest.mark.parametrize(("impl", "world_size"), [("triton", 2), ("torch", 2), ("triton", 1)])
def test_tp_vocab_sharded_equals_no_tp(impl, world_size):
    """world_size 1 is megatron's TP=1 group, which the trainer passes too."""
    hidden, weight, *_ = _problem()
    expected = _losses(hidden, weight, None, impl)
    ranks = run_distributed(_tp_rank, world_size, impl)
    for name, (loss, metrics, *grads) in expected.items():
        for rank, result in enumerate(ranks):
            rank_loss, rank_metrics, *rank_grads = result[name]
            torch.testing.assert_close(rank_loss, loss, rtol=0, atol=FORWARD_ATOL)
            for key in metrics:
                torch.testing.assert_close(rank_metrics[key], metrics[key], rtol=0, atol=FORWARD_ATOL)
            # grad_h (or nothing, for logits) is the full gradient; the last gradient is this rank's vocab shard
            for rank_grad, grad in zip(rank_grads[:-1], grads[:-1], strict=True):
                assert_close_to_scale(rank_grad, grad, GRAD_REL[torch.float32])
            shard_axis = 0 if name != "logits" else 1
            assert_close_to_scale(rank_grads[-1], grads[-1].chunk(world_size, dim=shard_axis)[rank],
                                  GRAD_REL[torch.float32])
