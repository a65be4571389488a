"""A padded output layer (megatron's vocab padded to 64 x TP) scores exactly what the unpadded one does: the rows
from ``vocab_size`` on are in no softmax, get an exact zero gradient, and a vocab-sharded layer whose last shard
is partly or wholly padding equals TP=1. The expected values come from plain ``torch.log_softmax`` over the real
columns only (no kernel code), and the padding rows hold large logits, so letting them in would show."""

import pytest
import torch
import torch.distributed as dist
from megatron_mimesis.kernels import (
    fused_linear_cross_entropy,
    fused_linear_logprobs,
    fused_linear_policy_loss,
    policy_loss_from_logits,
)
from megatron_mimesis.kernels import reference as ref
from megatron_mimesis.kernels.linear_logprob import linear_logprob
from megatron_mimesis.kernels.logits_logprob import logits_logprob

from tests.multiproc import run_distributed

from .helpers import FORWARD_ATOL, GRAD_REL, assert_close_to_scale, random_problem

N, REAL, ROWS, H = 37, 150, 192, 24  # 42 padding rows: more than one 32-wide interpreter tile


def _padded(num_rows=ROWS, real=REAL, dtype=torch.float32):
    """hidden, a padded weight whose padding rows make logits far above the real ones, and real targets."""
    hidden, weight, targets = random_problem(N, real, H, dtype, seed=4)
    padding = (5.0 * hidden[:1].float().sign() / H**0.5).repeat(num_rows - real, 1).to(dtype)
    return hidden, torch.cat([weight, padding]), targets


def _plain(hidden, weight, targets, grad_out, real=REAL):
    """log p, entropy and both gradients over the real rows only, by torch.log_softmax."""
    h = hidden.detach().float().requires_grad_()
    w = weight.detach()[:real].float().requires_grad_()
    logp = torch.log_softmax(h @ w.t(), dim=-1)
    logprob = logp.gather(1, targets[:, None])[:, 0]
    (logprob * grad_out).sum().backward()
    entropy = -(logp.exp() * logp).sum(-1)
    return logprob.detach(), entropy.detach(), h.grad, w.grad


@pytest.mark.parametrize("engine", [linear_logprob, ref.linear_logprob], ids=["triton", "reference"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_logprob_leaves_padding_rows_out(engine, dtype):
    hidden, weight, targets = _padded(dtype=dtype)
    hidden.requires_grad_()
    weight.requires_grad_()
    grad_out = torch.randn(N, generator=torch.Generator().manual_seed(1))
    logprob, entropy = engine(hidden, weight, targets, None, REAL)
    (logprob * grad_out).sum().backward()
    expected = _plain(hidden, weight, targets, grad_out)
    torch.testing.assert_close(logprob.float(), expected[0], rtol=0, atol=FORWARD_ATOL)
    torch.testing.assert_close(entropy.float(), expected[1], rtol=0, atol=FORWARD_ATOL)
    assert_close_to_scale(hidden.grad, expected[2], GRAD_REL[dtype])
    assert_close_to_scale(weight.grad[:REAL], expected[3], GRAD_REL[dtype])
    assert (weight.grad[REAL:] == 0).all()
    # without vocab_size the padding is in the softmax: the test above could fail
    assert (engine(hidden, weight, targets)[0].float() - expected[0]).abs().max() > 0.1


@pytest.mark.parametrize("engine", [linear_logprob, ref.linear_logprob], ids=["triton", "reference"])
def test_unpadded_vocab_size_changes_nothing(engine):
    hidden, weight, targets = random_problem(N, REAL, H, torch.float32, seed=4)
    torch.testing.assert_close(engine(hidden, weight, targets, None, REAL), engine(hidden, weight, targets),
                               rtol=0, atol=0)


@pytest.mark.parametrize("engine", [logits_logprob, ref.logprob_and_entropy_from_logits], ids=["triton", "reference"])
def test_logits_logprob_leaves_padding_columns_out(engine):
    hidden, weight, targets = _padded()
    logits = (hidden @ weight.t()).requires_grad_()
    grad_out = torch.randn(N, generator=torch.Generator().manual_seed(2))
    logprob, entropy = engine(logits, targets, None, REAL)
    (logprob * grad_out).sum().backward()
    plain_logits = logits.detach()[:, :REAL].clone().requires_grad_()
    logp = torch.log_softmax(plain_logits, -1)
    (logp.gather(1, targets[:, None])[:, 0] * grad_out).sum().backward()
    torch.testing.assert_close(logprob, logp.gather(1, targets[:, None])[:, 0], rtol=0, atol=FORWARD_ATOL)
    torch.testing.assert_close(entropy, -(logp.exp() * logp).sum(-1).detach(), rtol=0, atol=FORWARD_ATOL)
    assert_close_to_scale(logits.grad[:, :REAL], plain_logits.grad, GRAD_REL[torch.float32])
    assert (logits.grad[:, REAL:] == 0).all()


@pytest.mark.parametrize("impl", ["triton", "torch"])
def test_losses_take_vocab_size(impl):
    """Cross entropy, teacher log-probs and both policy losses pass vocab_size down to the engine."""
    hidden, weight, targets = _padded()
    mask = torch.ones(N)
    expected = _plain(hidden, weight, targets, torch.ones(N))[0]
    loss, _ = fused_linear_cross_entropy(hidden, weight, targets, mask, vocab_size=REAL, impl=impl)
    torch.testing.assert_close(loss, -expected.mean(), rtol=0, atol=FORWARD_ATOL)
    logprobs = fused_linear_logprobs(hidden, weight, targets, vocab_size=REAL, impl=impl)
    torch.testing.assert_close(logprobs, expected, rtol=0, atol=FORWARD_ATOL)
    advantages = torch.linspace(-1, 1, N)
    # old = current log-probs: ratio 1, so the GRPO loss is -mean(A) exactly when (and only when) the softmax is right
    _, metrics = fused_linear_policy_loss(hidden, weight, targets, mask, expected, advantages, vocab_size=REAL,
                                          impl=impl)
    assert metrics["approx_kl"].abs() <= 1e-6
    _, metrics = policy_loss_from_logits(hidden @ weight.t(), targets, mask, expected, advantages, vocab_size=REAL,
                                         impl=impl)
    assert metrics["approx_kl"].abs() <= 1e-6


def test_vocab_size_beyond_the_layer_is_refused():
    hidden, weight, targets = _padded()
    with pytest.raises(ValueError, match=r"vocab_size=193 must be in \[1, 192\]"):
        ref.linear_logprob(hidden, weight, targets, None, ROWS + 1)


def _tp_rank(rank, world_size, real, impl):
    hidden, weight, targets = _padded(num_rows=128, real=real)
    grad_out = torch.randn(N, generator=torch.Generator().manual_seed(3))
    h = hidden.clone().requires_grad_()
    shard = weight.chunk(world_size)[rank].contiguous().requires_grad_()
    engine = linear_logprob if impl == "triton" else ref.linear_logprob
    logprob, entropy = engine(h, shard, targets, dist.group.WORLD, real)
    (logprob * grad_out).sum().backward()
    dist.barrier()
    return logprob.detach(), entropy, h.grad, shard.grad


@pytest.mark.slow
@pytest.mark.parametrize("impl", ["triton", "torch"])
@pytest.mark.parametrize("real", [100, 50], ids=["last-shard-part-padding", "last-shard-all-padding"])
def test_tp2_padded_shards_equal_tp1(impl, real):
    """128 rows on 2 ranks (64 each): the second shard holds 36 real rows, or none."""
    hidden, weight, targets = _padded(num_rows=128, real=real)
    grad_out = torch.randn(N, generator=torch.Generator().manual_seed(3))
    expected = _plain(hidden, weight, targets, grad_out, real)
    full_grad_w = torch.cat([expected[3], torch.zeros(128 - real, H)])
    for rank, (logprob, entropy, grad_h, grad_w) in enumerate(run_distributed(_tp_rank, 2, real, impl)):
        torch.testing.assert_close(logprob, expected[0], rtol=0, atol=FORWARD_ATOL)
        torch.testing.assert_close(entropy, expected[1], rtol=0, atol=FORWARD_ATOL)
        assert_close_to_scale(grad_h, expected[2], GRAD_REL[torch.float32])
        assert_close_to_scale(grad_w, full_grad_w.chunk(2)[rank], GRAD_REL[torch.float32])
        padding = torch.arange(64) + 64 * rank >= real
        assert (grad_w[padding] == 0).all()
