"""FoldGRPO advantages and reward-to-go: Triton kernels against hand-computed cases and the reference."""

import pytest
import torch
from megatron_mimesis.kernels import discounted_returns, foldgrpo_advantages
from megatron_mimesis.kernels import reference as ref

EPS = 1e-6


@pytest.mark.parametrize("impl", ["triton", "torch"])
def test_foldgrpo_hand_computed_with_duplicate_rollout_rows(impl):
    # rows come unsorted; rollout ids repeat across groups (only (group, rollout) pairs identify a rollout)
    group_ids = torch.tensor([7, 0, 3, 0, 0, 7, 3, 0])
    rollout_ids = torch.tensor([4, 0, 0, 1, 0, 4, 1, 2])
    rewards = torch.tensor([2.0, 1.0, 0.5, 3.0, 1.0, 2.0, 0.5, 5.0])
    advantages = foldgrpo_advantages(rewards, group_ids, rollout_ids, eps=EPS, impl=impl)
    # group 0: rollouts {0: 1, 1: 3, 2: 5} (rollout 0 has two rows, counted once): mean 3, unbiased std 2
    #   (counting the duplicate would give mean 2.5). group 7: one rollout -> mean 0, std 1.
    #   group 3: all rewards equal -> std 0 -> advantage 0.
    expected = torch.tensor([2 / (1 + EPS), -2 / (2 + EPS), 0.0, 0.0, -2 / (2 + EPS), 2 / (1 + EPS), 0.0,
                             2 / (2 + EPS)])
    torch.testing.assert_close(advantages, expected, rtol=0, atol=1e-6)


@pytest.mark.parametrize("impl", ["triton", "torch"])
def test_zero_positive_advantage_of_negative_reward(impl):
    rewards = torch.tensor([-1.0, -3.0, 4.0, 2.0])
    group_ids = torch.tensor([0, 0, 1, 1])
    plain = foldgrpo_advantages(rewards, group_ids, eps=EPS, impl=impl)
    zeroed = foldgrpo_advantages(rewards, group_ids, eps=EPS, zero_positive_for_negative_reward=True, impl=impl)
    std = 2**0.5
    torch.testing.assert_close(plain, torch.tensor([1 / std, -1 / std, 1 / std, -1 / std]), rtol=0, atol=1e-5)
    torch.testing.assert_close(zeroed, torch.tensor([0.0, -1 / std, 1 / std, -1 / std]), rtol=0, atol=1e-5)


def test_plain_grpo_matches_per_group_formula():
    generator = torch.Generator().manual_seed(0)
    group_ids = torch.randint(0, 6, (64,), generator=generator) * 1000 + 17  # large, unsorted ids
    rewards = torch.randn(64, generator=generator)
    for unbiased in (True, False):
        advantages = foldgrpo_advantages(rewards, group_ids, eps=EPS, unbiased=unbiased, impl="triton")
        expected = torch.empty(64)
        for group in group_ids.unique():
            rows = group_ids == group
            values = rewards[rows]
            if rows.sum() > 1:
                expected[rows] = (values - values.mean()) / (values.std(unbiased=unbiased) + EPS)
            else:
                expected[rows] = values / (1 + EPS)
        torch.testing.assert_close(advantages, expected, rtol=0, atol=1e-5)


def test_foldgrpo_triton_matches_reference_random():
    generator = torch.Generator().manual_seed(1)
    group_ids = torch.randint(0, 5, (64,), generator=generator)
    rollout_ids = torch.randint(0, 6, (64,), generator=generator)
    rewards = torch.randn(64, generator=generator)
    for zero_positive in (False, True):
        kwargs = dict(eps=EPS, zero_positive_for_negative_reward=zero_positive)
        torch.testing.assert_close(foldgrpo_advantages(rewards, group_ids, rollout_ids, impl="triton", **kwargs),
                                   ref.group_advantages(rewards, group_ids, rollout_ids, **kwargs),
                                   rtol=0, atol=1e-5)


@pytest.mark.parametrize("impl", ["triton", "torch"])
def test_discounted_returns_hand_computed(impl):
    # episode 5 has turns with rewards 1, 0, 2 (rows 0, 2, 3); episode 2 is interleaved with one turn
    returns = discounted_returns(torch.tensor([1.0, 3.0, 0.0, 2.0]), torch.tensor([5, 2, 5, 5]), 0.8, impl=impl)
    torch.testing.assert_close(returns, torch.tensor([1 + 0.8 * (0 + 0.8 * 2), 3.0, 0.8 * 2, 2.0]))


def test_discounted_returns_triton_matches_reference_random():
    generator = torch.Generator().manual_seed(2)
    episode_ids = torch.randint(0, 7, (50,), generator=generator)
    rewards = torch.randn(50, generator=generator)
    torch.testing.assert_close(discounted_returns(rewards, episode_ids, 0.8, impl="triton"),
                               ref.discounted_returns(rewards, episode_ids, 0.8), rtol=0, atol=1e-6)


def test_turn_credits_by_hand():
    """UserRL's multi-turn advantage: rollout A's turn rewards [0, 1] give credits [0.8, 1] (gamma 0.8) over 2 and 3
    response tokens; B's are all 0. c_0 = 0.8 and 0: mean 0.4, unbiased std 0.4 * sqrt(2), so z_A = 1 / sqrt(2) and
    z_B = -z_A; N_A = 5 credited tokens, S_A = 0.8 * 2 + 1 * 3 = 4.6; B's credits sum to 0, so B gets nothing."""
    from megatron_mimesis.kernels import turn_credit_advantages

    credits = torch.tensor([0.8, 1.0, 0.0, 0.0, 0.5])
    out = turn_credit_advantages(credits, torch.tensor([0, 0, 0, 0, 1]), torch.tensor([5, 5, 9, 9, 3]),
                                 torch.tensor([2, 3, 4, 1, 6]))
    z = 0.4 / (0.4 * 2 ** 0.5 + 1e-6)
    # a group of one rollout has mean 0 and std 1 (veRL's GRPO, FoldGRPO's here): z = c_0 = 0.5, N / S = 6 / 3
    assert out.tolist() == pytest.approx([0.8 * z * 5 / 4.6, 1.0 * z * 5 / 4.6, 0.0, 0.0, 0.5 * 0.5 * 2], abs=1e-6)
    # the mean advantage over A's credited tokens is its z-score
    assert (out[0] * 2 + out[1] * 3) / 5 == pytest.approx(z, abs=1e-6)


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_a_group_whose_rollouts_scored_alike_gives_no_advantage(impl):
    """Agent RL's rows carry their turn's reward-to-go beside the G_0 the group statistics read: two rollouts that both
    succeeded at their second turn (rewards [0, 1], gamma 0.8) have G = [0.8, 1] each, so std(G_0) = 0; the second
    rows would get (1 - 0.8) / eps = 2e5 without the rule. The other group keeps its advantages."""
    rewards = torch.tensor([0.8, 1.0, 0.8, 1.0, 0.0, 1.0])
    groups, rollouts = torch.tensor([0, 0, 0, 0, 1, 1]), torch.tensor([0, 0, 1, 1, 2, 3])
    out = foldgrpo_advantages(rewards, groups, rollouts, impl=impl)
    assert out[:4].tolist() == [0.0] * 4
    assert out[4:].tolist() == pytest.approx([-(2 ** -0.5), 2 ** -0.5], abs=1e-5)
