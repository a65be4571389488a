"""FoldGRPO on folded rows: one rollout's several rows share its advantage, computed over unique rollouts."""

import pytest
import torch
from megatron_mimesis.kernels import foldgrpo_advantages

from megatron_mimesis.rl.simulator.episodes import fold_rows
from megatron_mimesis.rl.types import Episode, PolicyTurn


def _episode(group, rollout, turns, reward):
    turn = PolicyTurn(context_ids=[1, 2], response_ids=[3], response_logprobs=[-1.0], thinking=None,
                      utterance="x", finish_reason="stop")
    return Episode(prompt_id=f"p{group}", domain="d", group_id=group, rollout_id=rollout, turns=[turn] * turns,
                   reward=reward)


def test_rows_of_one_rollout_count_once_in_the_group_statistics():
    episodes = [_episode(0, 0, 3, 1.0), _episode(0, 1, 1, 0.0), _episode(0, 2, 2, 0.5),
                _episode(1, 3, 2, 0.2), _episode(1, 4, 1, None)]  # the last one failed scoring
    rows, stats = fold_rows(episodes)
    assert stats["unscored_episodes"] == 1 and len(rows) == 8
    adv = foldgrpo_advantages(torch.tensor([r.reward for r in rows]), torch.tensor([r.group_id for r in rows]),
                              torch.tensor([r.rollout_id for r in rows]), impl="torch")
    # group 0 over its 3 rollouts: mean 0.5, unbiased std 0.5; group 1 has one scored rollout: mean 0, std 1
    scale = 1 / (0.5 + 1e-6)
    expected = [0.5 * scale] * 3 + [-0.5 * scale] + [0.0] * 2 + [0.2] * 2
    assert adv.tolist() == pytest.approx(expected, abs=1e-6)
    row_mean = sum(r.reward for r in rows[:6]) / 6  # what counting rows instead of rollouts would use
    assert abs(row_mean - 0.5) > 0.1
