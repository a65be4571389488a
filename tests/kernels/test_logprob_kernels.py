"""Triton log-prob engines (hidden-state and logits input) against the fp32 reference: values and gradients."""

import pytest
import torch
from megatron_mimesis.kernels import reference as ref
from megatron_mimesis.kernels.linear_logprob import linear_logprob
from megatron_mimesis.kernels.logits_logprob import logits_logprob
from megatron_mimesis.kernels.vocab_tiles import geometry

from .helpers import FORWARD_ATOL, GRAD_REL, assert_close_to_scale, random_problem

# Interpreter tiles are 16 tokens x 32 vocab x 16 hidden: every shape below has ragged edges, several tiles and
# (V > 64) several vocab splits.
SHAPES = [(37, 150, 24), (64, 200, 32), (5, 33, 40)]


def _fp32_reference_grads(hidden, weight, targets, grad_out):
    hidden, weight = hidden.detach().float().requires_grad_(), weight.detach().float().requires_grad_()
    logprob, entropy = ref.linear_logprob(hidden, weight, targets)
    (logprob * grad_out).sum().backward()
    return logprob.detach(), entropy, hidden.grad, weight.grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES)
def test_linear_logprob_matches_reference(shape, dtype):
    hidden, weight, targets = random_problem(*shape, dtype)
    hidden.requires_grad_()
    weight.requires_grad_()
    grad_out = torch.randn(shape[0])
    grad_out[:20] = 0.0  # rows without gradient (masked tokens), including a whole token tile
    logprob, entropy = linear_logprob(hidden, weight, targets)
    (logprob * grad_out).sum().backward()
    ref_logprob, ref_entropy, ref_grad_h, ref_grad_w = _fp32_reference_grads(hidden, weight, targets, grad_out)
    torch.testing.assert_close(logprob, ref_logprob, rtol=0, atol=FORWARD_ATOL)
    torch.testing.assert_close(entropy, ref_entropy, rtol=0, atol=FORWARD_ATOL)
    assert hidden.grad.dtype == dtype and weight.grad.dtype == dtype
    assert_close_to_scale(hidden.grad, ref_grad_h, GRAD_REL[dtype])
    assert_close_to_scale(weight.grad, ref_grad_w, GRAD_REL[dtype])
    assert (hidden.grad[:20] == 0).all()


def test_linear_logprob_random_shapes():
    generator = torch.Generator().manual_seed(11)
    for seed in range(3):
        num_tokens, vocab, hidden_size = (int(torch.randint(lo, hi, (1,), generator=generator))
                                          for lo, hi in ((1, 65), (2, 201), (1, 33)))
        hidden, weight, targets = random_problem(num_tokens, vocab, hidden_size, torch.float32, seed)
        hidden.requires_grad_()
        weight.requires_grad_()
        grad_out = torch.randn(num_tokens, generator=generator)
        logprob, entropy = linear_logprob(hidden, weight, targets)
        (logprob * grad_out).sum().backward()
        expected = _fp32_reference_grads(hidden, weight, targets, grad_out)
        torch.testing.assert_close(logprob, expected[0], rtol=0, atol=FORWARD_ATOL)
        torch.testing.assert_close(entropy, expected[1], rtol=0, atol=FORWARD_ATOL)
        assert_close_to_scale(hidden.grad, expected[2], GRAD_REL[torch.float32])
        assert_close_to_scale(weight.grad, expected[3], GRAD_REL[torch.float32])


def test_linear_logprob_frozen_weight_gets_no_gradient():
    hidden, weight, targets = random_problem(20, 70, 16, torch.float32)
    hidden.requires_grad_()
    logprob, _ = linear_logprob(hidden, weight, targets)
    logprob.sum().backward()
    _, _, ref_grad_h, _ = _fp32_reference_grads(hidden, weight, targets, torch.ones(20))
    assert weight.grad is None
    assert_close_to_scale(hidden.grad, ref_grad_h, GRAD_REL[torch.float32])


@pytest.mark.parametrize(("dtype", "scale"), [(torch.float32, 3.0), (torch.bfloat16, 3.0), (torch.float32, 300.0)])
def test_logits_logprob_matches_reference(dtype, scale):
    generator = torch.Generator().manual_seed(3)
    logits = (scale * torch.randn(37, 150, generator=generator)).to(dtype).requires_grad_()
    targets = torch.randint(0, 150, (37,), generator=generator)
    grad_out = torch.randn(37, generator=generator)
    logprob, entropy = logits_logprob(logits, targets)
    (logprob * grad_out).sum().backward()
    ref_logits = logits.detach().float().requires_grad_()
    ref_logprob, ref_entropy = ref.logprob_and_entropy_from_logits(ref_logits, targets)
    (ref_logprob * grad_out).sum().backward()
    torch.testing.assert_close(logprob, ref_logprob, rtol=0, atol=FORWARD_ATOL)
    torch.testing.assert_close(entropy, ref_entropy, rtol=0, atol=FORWARD_ATOL)
    assert logits.grad.dtype == dtype
    assert_close_to_scale(logits.grad, ref_logits.grad, GRAD_REL[dtype])


def test_grid_stays_within_launch_limits_at_long_sequences():
    # 1M tokens at Qwen3.5's vocab: token tiles go on grid dim 0 (limit 2**31 - 1); dim 1 holds vocab splits.
    geo = geometry(1 << 20, 248320, 64, 128, torch.device("cpu"))
    assert geo.grid[0] * 64 >= 1 << 20 and geo.grid[1] <= 65535
    vocab_tiles = 248320 // 128
    assert (geo.splits - 1) * geo.tiles_per_split < vocab_tiles <= geo.splits * geo.tiles_per_split  # none empty
