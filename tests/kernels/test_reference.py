"""The PyTorch references are the specification: check them against hand-computed values and fp64 gradcheck."""

import math

import pytest
import torch
from megatron_mimesis.kernels import reference as ref


def test_logprob_and_entropy_match_log_softmax():
    torch.manual_seed(0)
    hidden, weight = torch.randn(7, 5, dtype=torch.float64), torch.randn(11, 5, dtype=torch.float64)
    targets = torch.randint(0, 11, (7,))
    logprob, entropy = ref.linear_logprob(hidden, weight, targets)
    log_softmax = torch.log_softmax(hidden @ weight.t(), -1)
    torch.testing.assert_close(logprob, log_softmax.gather(1, targets[:, None])[:, 0], rtol=0, atol=1e-12)
    torch.testing.assert_close(entropy, -(log_softmax.exp() * log_softmax).sum(-1), rtol=0, atol=1e-12)


def test_grpo_loss_hand_computed():
    # ratios exp(l - old) = e^0.5 (1.65), e^-0.5 (0.61), 1.1, 0.9 with eps 0.2 and advantages +1, -1, +2, -2
    logprobs = torch.tensor([0.5, -0.5, math.log(1.1), math.log(0.9)], dtype=torch.float64)
    advantages = torch.tensor([1.0, -1.0, 2.0, -2.0], dtype=torch.float64)
    loss = ref.grpo_per_token_loss(logprobs, torch.zeros(4, dtype=torch.float64), advantages,
                                   clip_eps_low=0.2, clip_eps_high=0.2)
    # token 0: min(1.65, 1.2) -> -1.2; token 1: min(-0.61, -0.8) -> 0.8; tokens 2, 3 inside the range
    torch.testing.assert_close(loss, torch.tensor([-1.2, 0.8, -2.2, 1.8], dtype=torch.float64))
    dual = ref.grpo_per_token_loss(torch.tensor([2.0], dtype=torch.float64), torch.zeros(1, dtype=torch.float64),
                                   torch.tensor([-1.0], dtype=torch.float64), clip_eps_low=0.2, clip_eps_high=0.2,
                                   dual_clip_c=3.0)
    torch.testing.assert_close(dual, torch.tensor([3.0], dtype=torch.float64))  # e^2 = 7.39 bounded by c = 3
    capped = ref.grpo_per_token_loss(torch.tensor([2.0], dtype=torch.float64), torch.zeros(1, dtype=torch.float64),
                                     torch.tensor([-1.0], dtype=torch.float64), clip_eps_low=0.2, clip_eps_high=0.2,
                                     ratio_upper_clamp=5.0)
    torch.testing.assert_close(capped, torch.tensor([5.0], dtype=torch.float64))


def test_aggregations_hand_computed():
    per_token = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0, 6.0])
    mask = torch.tensor([1, 1, 0, 1, 0, 0])
    cu_seqlens = torch.tensor([0, 3, 5, 6])
    assert ref.aggregate(per_token, mask).item() == pytest.approx(7.0 / 3)
    assert ref.aggregate(per_token, mask, normalizer=torch.tensor(10.0)).item() == pytest.approx(0.7)
    # sequence means 1.5 and 4.0; the third sequence has no loss token and is not counted
    assert ref.aggregate(per_token, mask, "seq-mean-token-mean", cu_seqlens).item() == pytest.approx(2.75)
    assert ref.aggregate(per_token, mask, "seq-mean-token-mean", cu_seqlens, normalizer=4).item() == pytest.approx(
        5.5 / 4)


def test_masked_padding_cannot_poison_loss_or_gradient():
    logprobs = torch.tensor([-1.0, -2.0], requires_grad=True)
    old = torch.tensor([-1.0, float("-inf")])  # padding position carries -inf
    loss, metrics = ref.policy_loss_from_logprobs(logprobs, torch.zeros(2), torch.tensor([1, 0]), old,
                                                  torch.tensor([1.0, 1.0]))
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(logprobs.grad).all() and logprobs.grad[1] == 0
    assert torch.isfinite(metrics["approx_kl"])


def test_gradcheck_policy_loss_fp64():
    torch.manual_seed(1)
    n, v, h = 6, 9, 4
    hidden = torch.randn(n, h, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(v, h, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, v, (n,))
    mask = torch.tensor([1, 1, 0, 1, 1, 1])
    with torch.no_grad():
        old = ref.linear_logprob(hidden, weight, targets)[0] + 0.05 * torch.randn(n, dtype=torch.float64)
    advantages = torch.randn(n, dtype=torch.float64)

    # The CSD term is left out on purpose: its stop-gradient gate makes finite differences disagree with the
    # intended gradient by design; the next test checks that gradient instead.
    def loss_fn(hidden, weight):
        logprobs, entropy = ref.linear_logprob(hidden, weight, targets)
        return ref.policy_loss_from_logprobs(logprobs, entropy, mask, old, advantages, dual_clip_c=3.0)[0]

    assert torch.autograd.gradcheck(loss_fn, (hidden, weight))


def test_csd_gradient_is_gradient_of_gated_nll_with_detached_gate():
    torch.manual_seed(2)
    logits = torch.randn(8, 13, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 13, (8,))
    teacher = torch.randn(8, dtype=torch.float64) - 2.5
    mask = torch.ones(8)
    logprobs, entropy = ref.logprob_and_entropy_from_logits(logits, targets)
    # csd only: zero advantages make the GRPO term constant
    loss, _ = ref.policy_loss_from_logprobs(logprobs, entropy, mask, logprobs.detach(), torch.zeros(8),
                                            teacher_logprobs=teacher, csd_alpha=1.0, csd_beta=5.0)
    (grad,) = torch.autograd.grad(loss, logits)
    log_p = torch.log_softmax(logits, -1).gather(1, targets[:, None])[:, 0]
    gate = torch.sigmoid(5.0 * (teacher - log_p)).detach()
    (expected,) = torch.autograd.grad(-(gate * log_p).mean(), logits)
    torch.testing.assert_close(grad, expected, rtol=1e-12, atol=1e-12)


def test_reference_kl_term_is_k3_by_hand_and_vanishes_at_the_reference():
    torch.manual_seed(3)
    n, kl_coef = 10, 0.1
    logprobs = (-torch.rand(n, dtype=torch.float64) * 3).requires_grad_()
    mask = torch.tensor([1, 1, 1, 0, 1, 1, 0, 1, 1, 1], dtype=torch.float64)
    old, advantages = logprobs.detach(), torch.zeros(n, dtype=torch.float64)  # GRPO term constant
    reference_lp = logprobs.detach() + torch.randn(n, dtype=torch.float64)
    reference_lp[3] = -1e4  # a masked position with a far-off reference must not leak inf/NaN
    loss, metrics = ref.policy_loss_from_logprobs(logprobs, None, mask, old, advantages, ref_logprobs=reference_lp,
                                                        kl_coef=kl_coef)
    loss.backward()
    d = (reference_lp - logprobs.detach()) * mask
    k3 = d.exp() - d - 1
    assert metrics["kl_ref"].item() == pytest.approx((k3 * mask).sum().item() / mask.sum().item())
    # d/dl [exp(ref - l) - (ref - l) - 1] = 1 - exp(ref - l), times kl_coef / loss tokens; the GRPO term's gradient
    # at ratio 1 with zero advantages is 0
    expected = kl_coef * (1 - d.exp()) * mask / mask.sum()
    assert torch.allclose(logprobs.grad, expected, rtol=1e-10, atol=1e-12)
    same, metrics = ref.policy_loss_from_logprobs(logprobs.detach(), None, mask, old, advantages,
                                                        ref_logprobs=logprobs.detach(), kl_coef=kl_coef)
    assert metrics["kl_ref"].item() == 0.0 and same.item() == pytest.approx(0.0, abs=1e-12)


def _correction(diffs_per_sequence, mode, level, cap=2.0):
    """Weights and metrics for sequences of given log ratios (trainer - engine), the engine's log-probs at -1."""
    diffs = torch.tensor([d for seq in diffs_per_sequence for d in seq], dtype=torch.float64)
    sequence_ids = torch.tensor([i for i, seq in enumerate(diffs_per_sequence) for _ in seq])
    engine = torch.full_like(diffs, -1.0)
    return ref.rollout_correction_weights(engine + diffs, engine, sequence_ids, mode=mode, level=level, cap=cap)


# ratios: sequence 0 = 1, 3, 1/4 (geometric mean (3/4)^(1/3) = 0.9086); sequence 1 = 1.5, 1.5
DIFFS = [[0.0, math.log(3.0), -math.log(4.0)], [math.log(1.5), math.log(1.5)]]


@pytest.mark.parametrize(("mode", "level", "cap", "expected", "acted"), [
    ("tis", "token", 2.0, [1.0, 2.0, 0.25, 1.5, 1.5], ("is_truncated_frac", 1 / 5)),  # 3 truncated to the cap
    ("mis", "token", 2.0, [1.0, 0.0, 0.0, 1.5, 1.5], ("is_masked_frac", 2 / 5)),  # 3 and 1/4 leave [1/2, 2]
    ("tis", "sequence", 1.4, [0.75 ** (1 / 3)] * 3 + [1.4] * 2, ("is_truncated_frac", 2 / 5)),
    ("mis", "sequence", 1.4, [0.75 ** (1 / 3)] * 3 + [0.0] * 2, ("is_masked_frac", 2 / 5)),  # 1.5 > 1.4: row out
    ("off", "token", 2.0, [1.0] * 5, None),
])
def test_rollout_correction_weights_hand_computed(mode, level, cap, expected, acted):
    weights, metrics = _correction(DIFFS, mode, level, cap)
    torch.testing.assert_close(weights, torch.tensor(expected, dtype=torch.float64), rtol=1e-12, atol=1e-12)
    diffs = [d for seq in DIFFS for d in seq]
    assert metrics["engine_kl"].item() == pytest.approx(sum(math.exp(d) - d - 1 for d in diffs) / 5)
    assert metrics["engine_logprob_abs_diff"].item() == pytest.approx(sum(abs(d) for d in diffs) / 5)
    assert metrics["engine_logprob_abs_diff_max"].item() == pytest.approx(math.log(4.0))
    ratios = [math.exp(d) for d in diffs] if level == "token" else [0.75 ** (1 / 3)] * 3 + [1.5] * 2
    assert metrics["is_ratio_mean"].item() == pytest.approx(sum(ratios) / 5)
    assert (metrics["is_ratio_min"].item(), metrics["is_ratio_max"].item()) == pytest.approx((min(ratios),
                                                                                                max(ratios)))
    assert metrics["is_weight_mean"].item() == pytest.approx(sum(expected) / 5)
    shares = {k for k in metrics if k in ("is_truncated_frac", "is_masked_frac")}
    assert shares == ({acted[0]} if acted else set())
    if acted:
        assert metrics[acted[0]].item() == pytest.approx(acted[1])


@pytest.mark.parametrize("mode", ["tis", "mis", "off"])
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_rollout_weights_are_exactly_one_where_engine_and_trainer_agree(mode, level):
    logprobs = -torch.rand(7, dtype=torch.float64) * 5
    weights, metrics = ref.rollout_correction_weights(logprobs, logprobs.clone(), torch.tensor([0, 0, 0, 1, 1, 2, 2]),
                                                      mode=mode, level=level, cap=2.0)
    assert torch.equal(weights, torch.ones(7, dtype=torch.float64))
    assert metrics["engine_kl"].item() == 0.0 and metrics["engine_logprob_abs_diff_max"].item() == 0.0


def test_a_token_the_engine_could_not_sample_gets_a_bounded_weight():
    trainer = torch.tensor([-1.0, -2.0], dtype=torch.float64)
    engine = torch.tensor([float("-inf"), -2.0], dtype=torch.float64)  # e.g. a token outside the engine's top-p
    weights, metrics = ref.rollout_correction_weights(trainer, engine, torch.tensor([0, 0]), mode="tis", level="token",
                                                      cap=2.0)
    assert weights.tolist() == [2.0, 1.0] and metrics["is_ratio_max"].item() == pytest.approx(math.exp(20.0))
    assert math.isfinite(metrics["engine_kl"].item()) and metrics["engine_logprob_abs_diff_max"].item() == math.inf
    weights, _ = ref.rollout_correction_weights(trainer, engine, torch.tensor([0, 0]), mode="mis", level="sequence",
                                                cap=2.0)
    assert weights.tolist() == [0.0, 0.0]  # exp(min(inf, 20) / 2) is far outside the band: the row is rejected


@pytest.mark.parametrize(("options", "message"), [
    (dict(mode="clip", level="token", cap=2.0), "mode"),
    (dict(mode="tis", level="geometric", cap=2.0), "level"),
    (dict(mode="tis", level="token", cap=1.0), "cap"),
])
def test_rollout_correction_options_are_checked(options, message):
    x = torch.zeros(2, dtype=torch.float64)
    with pytest.raises(ValueError, match=message):
        ref.rollout_correction_weights(x, x, torch.tensor([0, 0]), **options)


def test_rollout_weights_multiply_the_grpo_and_csd_terms_only():
    torch.manual_seed(4)
    n, v, eps, alpha, beta, kl_coef = 12, 17, 0.2, 0.5, 5.0, 0.3
    logits = torch.randn(n, v, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, v, (n,))
    mask = torch.tensor([1, 1, 1, 0, 1, 1, 1, 1, 0, 1, 1, 1], dtype=torch.float64)
    log_p = torch.log_softmax(logits, -1).gather(1, targets[:, None])[:, 0]
    old = log_p.detach() + 0.3 * torch.randn(n, dtype=torch.float64)
    advantages, teacher = torch.randn(n, dtype=torch.float64), log_p.detach() + torch.randn(n, dtype=torch.float64)
    reference_lp = log_p.detach() + torch.randn(n, dtype=torch.float64)
    weights = torch.rand(n, dtype=torch.float64) * 2
    options = dict(teacher_logprobs=teacher, csd_alpha=alpha, csd_beta=beta, ref_logprobs=reference_lp,
                   kl_coef=kl_coef, clip_eps_low=eps, clip_eps_high=eps)
    logprobs, entropy = ref.logprob_and_entropy_from_logits(logits, targets)
    loss, metrics = ref.policy_loss_from_logprobs(logprobs, entropy, mask, old, advantages, rollout_weights=weights,
                                                  **options)
    (grad,) = torch.autograd.grad(loss, logits)
    # the formula: weights on -min(r A, clip(r) A) and on -g l; the gate and the k3 KL unweighted
    ratio = (log_p - old).exp()
    grpo = -torch.minimum(ratio * advantages, ratio.clamp(1 - eps, 1 + eps) * advantages)
    gate = torch.sigmoid(beta * (teacher - log_p)).detach()
    d = reference_lp - log_p
    expected = ((weights * grpo + alpha * weights * -gate * log_p + kl_coef * (d.exp() - d - 1)) * mask).sum() / mask.sum()
    (expected_grad,) = torch.autograd.grad(expected, logits)
    torch.testing.assert_close(loss, expected, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grad, expected_grad, rtol=1e-10, atol=1e-12)
    _, unweighted = ref.policy_loss_from_logprobs(logprobs.detach(), entropy, mask, old, advantages, **options)
    for name in ("clip_frac_low", "clip_frac_high", "approx_kl", "mean_gate", "kl_ref", "kl_loss"):
        assert metrics[name].item() == unweighted[name].item(), name  # metrics describe the tokens as sampled
