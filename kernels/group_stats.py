"""FoldGRPO group statistics and multi-turn reward-to-go as segmented Triton kernels, with no host syncs.

Rows are ordered on the device by (group, rollout, row) with two stable argsorts, so ids may come sorted or not
and of any integer value; segment starts come from a scatter-min, so the number of groups never has to be read
on the host. One program per possible segment (at most one per row) walks its segment: sums over the first row
of each rollout, a second pass for the centred sum of squares (numerically safer than sum of squares), and a
third that writes every row's advantage back to its original position (group_stats_kernels.py, imported only
when Triton runs, so a machine without Triton still gets the reference).
"""

import torch

from . import reference
from .dispatch import resolve_impl
from .launch_config import launch


def _run_heads(*sorted_keys):
    """True at row 0 and wherever any of the (sorted) keys differs from the previous row."""
    head = torch.zeros(sorted_keys[0].shape[0], dtype=torch.bool, device=sorted_keys[0].device)
    head[:1] = True
    for keys in sorted_keys:
        head[1:] |= keys[1:] != keys[:-1]
    return head


def _segment_starts(heads):
    """[n + 1] tensor: start row of each segment, then n for every slot past the last segment."""
    n = heads.shape[0]
    starts = torch.full((n + 1,), n, dtype=torch.int64, device=heads.device)
    return starts.scatter_reduce(0, torch.cumsum(heads, 0) - 1, torch.arange(n, device=heads.device), reduce="amin")


def foldgrpo_advantages(rewards, group_ids, rollout_ids=None, *, eps=1e-6, unbiased=True,
                        zero_positive_for_negative_reward=False, impl="auto"):
    """Per-row (reward - mean_g) / (std_g + eps), statistics over the first row of each unique rollout id.

    ``rollout_ids=None`` is plain GRPO (every row its own rollout). A group with a single rollout gets mean 0 and
    std 1. ``zero_positive_for_negative_reward`` zeroes positive advantages of rows whose raw reward is negative.
    """
    if resolve_impl(impl, rewards) == "torch":
        return reference.group_advantages(rewards, group_ids, rollout_ids, eps=eps, unbiased=unbiased,
                                          zero_positive_for_negative_reward=zero_positive_for_negative_reward)
    n = rewards.shape[0]
    if rollout_ids is None:
        rollout_ids = torch.arange(n, device=rewards.device)
    by_rollout = torch.argsort(rollout_ids, stable=True)
    order = by_rollout[torch.argsort(group_ids[by_rollout], stable=True)]
    groups, rollouts = group_ids[order], rollout_ids[order]
    starts = _segment_starts(_run_heads(groups))
    first_of_rollout = _run_heads(groups, rollouts).to(torch.int8)
    from .group_stats_kernels import group_advantage_kernel

    out = torch.empty(n, dtype=torch.float32, device=rewards.device)
    config = launch("group_stats.group_advantage", rewards.device)
    group_advantage_kernel[(n,)](rewards.float()[order].contiguous(), first_of_rollout, order, starts, out, n, eps,
                                 UNBIASED=unbiased, ZERO_POSITIVE_FOR_NEGATIVE=zero_positive_for_negative_reward,
                                 **config.constexprs, **config.options)
    return out


def discounted_returns(rewards_per_turn, episode_ids, gamma=0.8, *, impl="auto"):
    """Reward-to-go over the turns of multi-turn episodes: G_t = r_t + gamma * G_{t+1}, turns in row order
    within each episode (episodes may interleave). The paper uses gamma 0.8."""
    if resolve_impl(impl, rewards_per_turn) == "torch":
        return reference.discounted_returns(rewards_per_turn, episode_ids, gamma)
    n = rewards_per_turn.shape[0]
    order = torch.argsort(episode_ids, stable=True)
    starts = _segment_starts(_run_heads(episode_ids[order]))
    from .group_stats_kernels import discounted_returns_kernel

    out = torch.empty(n, dtype=torch.float32, device=rewards_per_turn.device)
    config = launch("group_stats.discounted_returns", rewards_per_turn.device)
    discounted_returns_kernel[(n,)](rewards_per_turn.float()[order].contiguous(), order, starts, out, n, gamma,
                                    **config.options)
    return out


def turn_credit_advantages(credits, group_ids, rollout_ids, response_lengths, *, eps=1e-6):
    """UserRL's multi-turn advantage (``grpo_multiturn`` with R2G turn credits and an R2G trajectory score), per row.

    Rows are turns, in turn order within each rollout (ids unique across groups); ``credits`` are each turn's
    reward-to-go c_t = r_t + gamma c_{t+1}, so a rollout's first row holds its trajectory score c_0. With z the
    rollout's z-score of c_0 in its group ((c_0 - mean) / (std + eps), unbiased std over the group's rollouts), N its
    response tokens whose turn has a nonzero credit and S the sum of credits over its response tokens, every token of
    turn t gets c_t z N / S: the mean advantage per credited token is z, spread over the turns by their credit. An
    episode whose credits sum to 0 (every turn reward 0) gets 0, so a failed episode pushes nothing down. Plain
    PyTorch: one value per row (turns, not tokens), where a kernel would buy nothing."""
    credits, lengths = credits.float(), response_lengths.float()
    _, rollout = torch.unique(rollout_ids, return_inverse=True)
    count = int(rollout.max()) + 1 if rollout.numel() else 0
    rows = torch.arange(credits.shape[0], device=credits.device)
    first = torch.full((count,), credits.shape[0], dtype=torch.long, device=credits.device)
    first = first.scatter_reduce(0, rollout, rows, reduce="amin")
    z = reference.group_advantages(credits[first], group_ids[first], eps=eps).to(credits.device)
    total = torch.zeros(count, device=credits.device).index_add(0, rollout, credits * lengths)
    credited = torch.zeros(count, device=credits.device).index_add(0, rollout, lengths * (credits != 0).float())
    scale = torch.where(total != 0, z * credited / torch.where(total != 0, total, 1.0), 0.0)
    return credits * scale[rollout]
