"""Public API: Triton path against the reference path (impl="torch"), and against independent formulas."""

import warnings

import pytest
import torch
import torch.nn.functional as F
from megatron_mimesis.kernels import (
    dispatch,
    fused_linear_cross_entropy,
    fused_linear_policy_loss,
    policy_loss_from_logits,
)
from megatron_mimesis.kernels import reference as ref

from .helpers import FORWARD_ATOL, GRAD_REL, assert_close_to_scale, random_problem

N, V, H = 40, 150, 24
CU_SEQLENS = torch.tensor([0, 9, 17, 30, 40])


def _rl_batch(dtype, seed=0):
    hidden, weight, targets = random_problem(N, V, H, dtype, seed)
    generator = torch.Generator().manual_seed(seed + 100)
    with torch.no_grad():
        current, _ = ref.linear_logprob(hidden, weight, targets)
    mask = (torch.rand(N, generator=generator) > 0.2).long()
    mask[9:17] = 0  # a whole sequence without loss tokens
    old = current + 0.3 * torch.randn(N, generator=generator)  # off-policy enough that some ratios clip
    advantages = torch.randn(N, generator=generator)
    teacher = current + torch.randn(N, generator=generator)
    return hidden, weight, targets, mask, old, advantages, teacher


# rollout-correction weights as TIS / MIS produce them: truncated at 2, some tokens rejected (0)
ROLLOUT_WEIGHTS = torch.linspace(0.3, 2.0, N).roll(7)
ROLLOUT_WEIGHTS[::6] = 0.0

CASES = {
    "grpo-token-mean": dict(),
    "grpo-csd-rollout-weights": dict(csd_alpha=0.5, rollout_weights=ROLLOUT_WEIGHTS),
    "grpo-csd-seq-mean-dual-clip": dict(csd_alpha=0.5, loss_agg="seq-mean-token-mean", cu_seqlens=CU_SEQLENS,
                                        dual_clip_c=3.0, ratio_upper_clamp=4.0, clip_eps_high=0.28),
    "grpo-csd-normalizer": dict(csd_alpha=0.01, normalizer=torch.tensor(100.0)),
}


def _run(loss_fn, first_input, weight, case, batch, impl):
    _, _, targets, mask, old, advantages, teacher = batch
    first_input = first_input.detach().clone().requires_grad_()
    inputs = [first_input]
    if weight is not None:
        weight = weight.detach().clone().requires_grad_()
        inputs.append(weight)
    teacher_lp = teacher if "csd_alpha" in case else None
    loss, metrics = loss_fn(*inputs, targets, mask, old, advantages, teacher_logprobs=teacher_lp,
                            return_entropy=True, impl=impl, **case)
    loss.backward()
    return loss, metrics, [x.grad for x in inputs]


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_linear_policy_loss_matches_reference(case, dtype):
    batch = _rl_batch(dtype)
    hidden, weight = batch[0], batch[1]
    loss, metrics, grads = _run(fused_linear_policy_loss, hidden, weight, CASES[case], batch, "triton")
    ref_loss, ref_metrics, ref_grads = _run(fused_linear_policy_loss, hidden.float(), weight.float(), CASES[case],
                                            batch, "torch")
    torch.testing.assert_close(loss, ref_loss, rtol=0, atol=FORWARD_ATOL)
    assert metrics.keys() == ref_metrics.keys()
    for name in metrics:
        torch.testing.assert_close(metrics[name], ref_metrics[name], rtol=0, atol=FORWARD_ATOL)
    assert metrics["clip_frac_low"] > 0 and metrics["clip_frac_high"] > 0
    for grad, ref_grad in zip(grads, ref_grads, strict=True):
        assert grad.dtype == dtype
        assert_close_to_scale(grad, ref_grad, GRAD_REL[dtype])


@pytest.mark.parametrize("case", ["grpo-token-mean", "grpo-csd-seq-mean-dual-clip", "grpo-csd-rollout-weights"])
def test_policy_loss_from_logits_matches_reference(case):
    batch = _rl_batch(torch.float32, seed=1)
    logits = batch[0] @ batch[1].t()
    loss, metrics, (grad,) = _run(policy_loss_from_logits, logits, None, CASES[case], batch, "triton")
    ref_loss, ref_metrics, (ref_grad,) = _run(policy_loss_from_logits, logits, None, CASES[case], batch, "torch")
    torch.testing.assert_close(loss, ref_loss, rtol=0, atol=FORWARD_ATOL)
    torch.testing.assert_close(metrics["entropy"], ref_metrics["entropy"], rtol=0, atol=FORWARD_ATOL)
    assert_close_to_scale(grad, ref_grad, GRAD_REL[torch.float32])


@pytest.mark.parametrize("loss_fn", ["fused", "logits"])
def test_rollout_weights_of_one_leave_loss_metrics_and_gradients_bit_for_bit_unchanged(loss_fn):
    """Where engine and trainer agree every weight is 1: the weighted loss is today's, to the bit."""
    batch = _rl_batch(torch.bfloat16 if loss_fn == "fused" else torch.float32, seed=3)
    hidden, weight = batch[0], batch[1]
    reference_lp = batch[4] - 0.5
    case = dict(csd_alpha=0.5, ref_logprobs=reference_lp, kl_coef=0.1)
    fn, inputs = ((fused_linear_policy_loss, (hidden, weight)) if loss_fn == "fused" else
                  (policy_loss_from_logits, (hidden.float() @ weight.float().t(), None)))
    today = _run(fn, *inputs, case, batch, "triton")
    weighted = _run(fn, *inputs, {**case, "rollout_weights": torch.ones(N)}, batch, "triton")
    assert torch.equal(weighted[0], today[0])
    assert weighted[1].keys() == today[1].keys() and all(torch.equal(weighted[1][k], today[1][k]) for k in today[1])
    assert all(torch.equal(a, b) for a, b in zip(weighted[2], today[2], strict=True))


def test_kernel_csd_gradient_is_gradient_of_gated_nll_with_detached_gate():
    hidden, weight, targets, mask, _, _, teacher = _rl_batch(torch.float32, seed=2)
    hidden.requires_grad_()
    with torch.no_grad():
        current, _ = ref.linear_logprob(hidden, weight, targets)
    # zero advantages leave only the CSD term
    loss, _ = fused_linear_policy_loss(hidden, weight, targets, mask, current, torch.zeros(N),
                                       teacher_logprobs=teacher, csd_alpha=1.0, csd_beta=5.0, impl="triton")
    (grad,) = torch.autograd.grad(loss, hidden)
    log_p = torch.log_softmax(hidden @ weight.t(), -1).gather(1, targets[:, None])[:, 0]
    gate = torch.sigmoid(5.0 * (teacher - log_p)).detach()
    (expected,) = torch.autograd.grad(-(gate * log_p)[mask.bool()].mean(), hidden)
    assert_close_to_scale(grad, expected, GRAD_REL[torch.float32])


def test_fully_masked_batch_gives_zero_loss_and_gradient():
    hidden, weight, targets, _, old, advantages, teacher = _rl_batch(torch.float32)
    hidden.requires_grad_()
    loss, metrics = fused_linear_policy_loss(hidden, weight, targets, torch.zeros(N), old, advantages,
                                             teacher_logprobs=teacher, csd_alpha=1.0, impl="triton")
    loss.backward()
    assert loss.item() == 0.0 and (hidden.grad == 0).all() and metrics["clip_frac_low"] == 0


@pytest.mark.parametrize("impl", ["triton", "torch"])
def test_cross_entropy_matches_torch_cross_entropy(impl):
    hidden, weight, targets = random_problem(N, V, H, torch.float32, seed=4)
    mask = torch.ones(N)
    mask[::3] = 0
    targets = torch.where(mask.bool(), targets, -100)  # megatron-style ignored labels on masked positions
    hidden.requires_grad_()
    weight.requires_grad_()
    loss, metrics = fused_linear_cross_entropy(hidden, weight, targets, mask, impl=impl)
    grads = torch.autograd.grad(loss, (hidden, weight))
    expected = F.cross_entropy(hidden @ weight.t(), targets, ignore_index=-100)
    expected_grads = torch.autograd.grad(expected, (hidden, weight))
    torch.testing.assert_close(loss, expected, rtol=0, atol=FORWARD_ATOL)
    assert metrics["num_tokens"] == mask.sum()
    for grad, expected_grad in zip(grads, expected_grads, strict=True):
        assert_close_to_scale(grad, expected_grad, GRAD_REL[torch.float32])


def test_global_normalizer_makes_gradient_accumulation_exact():
    hidden, weight, targets = random_problem(N, V, H, torch.float32, seed=5)
    mask = (torch.arange(N) % 4 != 0).float()
    weight.requires_grad_()
    full, _ = fused_linear_cross_entropy(hidden, weight, targets, mask, impl="triton")
    (full_grad,) = torch.autograd.grad(full, weight)
    total = mask.sum()
    halves = [slice(0, 13), slice(13, N)]  # unequal micro-batches
    parts = [fused_linear_cross_entropy(hidden[s], weight, targets[s], mask[s], normalizer=total, impl="triton")[0]
             for s in halves]
    accumulated = sum(torch.autograd.grad(p, weight)[0] for p in parts)
    torch.testing.assert_close(sum(parts), full, rtol=0, atol=FORWARD_ATOL)
    assert_close_to_scale(accumulated, full_grad, GRAD_REL[torch.float32])


def test_auto_falls_back_to_reference_on_cpu_with_one_warning(monkeypatch):
    monkeypatch.setattr(dispatch, "_warned", False)
    hidden, weight, targets = random_problem(8, 20, 16, torch.float32)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loss, _ = fused_linear_cross_entropy(hidden, weight, targets, torch.ones(8))
        fused_linear_cross_entropy(hidden, weight, targets, torch.ones(8))
    assert len([w for w in caught if "PyTorch reference" in str(w.message)]) == 1
    torch.testing.assert_close(loss, F.cross_entropy(hidden @ weight.t(), targets))
    with pytest.raises(ValueError, match="impl"):
        fused_linear_cross_entropy(hidden, weight, targets, torch.ones(8), impl="cuda")


@pytest.mark.parametrize(("options", "message"), [
    (dict(loss_agg="sum"), "loss_agg"),
    (dict(loss_agg="seq-mean-token-mean"), "cu_seqlens"),
    (dict(dual_clip_c=0.5), "dual_clip_c"),
])
def test_invalid_options_are_rejected_up_front(options, message):
    hidden, weight, targets, mask, old, advantages, _ = _rl_batch(torch.float32)
    with pytest.raises(ValueError, match=message):
        fused_linear_policy_loss(hidden, weight, targets, mask, old, advantages, impl="triton", **options)
