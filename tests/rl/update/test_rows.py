"""A step's rows travel between data-parallel ranks as tensors: what every rank receives equals the rows of all
ranks built in one place, whatever fields each rank has (a rank without rows, rows sampled elsewhere on one rank
only), and selecting rows keeps each row's tokens and per-token values together."""

import pytest
import torch

from megatron_mimesis.rl.types import TrainingRow
from megatron_mimesis.rl.update.rows import StepRows
from tests.multiproc import run_distributed


def _row(group, rollout, context, response, engine=False):
    logprobs = [-0.1 * (k + 1) - rollout for k in range(len(response))]
    return TrainingRow(group, rollout, context, response, logprobs, reward=0.5 * rollout, domain="d",
                       engine_logprobs=[lp - 0.01 for lp in logprobs] if engine else None)


RANK_ROWS = [
    [_row(0, 0, [1, 2], [3, 4, 5]), _row(0, 1, [6], [7])],  # sampled by the training model
    [],  # nothing to train on this rank this step
    [_row(1, 2, [8, 9, 10], [11, 12], engine=True)],  # sampled by another engine
]


def _gather(rank, world_size):
    rows = StepRows.of_rows(RANK_ROWS[rank], teacher=[[-1.0] * len(r.response_ids) for r in RANK_ROWS[rank]])
    gathered = rows.gathered(torch.distributed.group.WORLD, torch.device("cpu"))
    return {name: getattr(gathered, name) for name in ("tokens", "lengths", "context_lengths", "group_ids",
                                                        "rollout_ids", "rewards")} | {"response": gathered.response}


@pytest.mark.slow
def test_every_rank_receives_every_ranks_rows_with_the_fields_any_rank_has():
    everything = [r for part in RANK_ROWS for r in part]
    expected = StepRows.of_rows(everything, teacher=[[-1.0] * len(r.response_ids) for r in everything])
    for received in run_distributed(_gather, 3):
        for name in ("tokens", "lengths", "context_lengths", "group_ids", "rollout_ids", "rewards"):
            assert torch.equal(received[name], getattr(expected, name)), name
        assert received["response"].keys() == expected.response.keys() == {"old_logprobs", "engine_logprobs",
                                                                           "teacher_logprobs"}
        for name, values in expected.response.items():
            assert torch.equal(received["response"][name], values), name


def test_selecting_rows_keeps_their_tokens_and_values_together():
    rows = StepRows.of_rows([r for part in RANK_ROWS for r in part])
    kept = rows.select(torch.tensor([True, False, True]))
    assert kept.tokens.tolist() == [1, 2, 3, 4, 5, 8, 9, 10, 11, 12] and kept.lengths.tolist() == [5, 5]
    assert kept.rollout_ids.tolist() == [0, 2] and kept.rewards.tolist() == [0.0, 1.0]
    assert kept.response["old_logprobs"].tolist() == pytest.approx([-0.1, -0.2, -0.3, -2.1, -2.2])
    assert kept.response["engine_logprobs"].tolist() == pytest.approx([-0.1, -0.2, -0.3, -2.11, -2.21])
    assert kept.response_row_index().tolist() == [0, 0, 0, 1, 1]


def test_one_optimizer_step_takes_the_batch_as_it_is_and_several_split_it_by_group():
    """One step per batch: one mini-batch of every row in order, whose record is that step's own, so the update is
    the one-step update of before mini-batches. Four: the groups cut into runs of (near) equal size."""
    from megatron_mimesis.rl.loop import merged_steps, minibatch_groups

    group_ids = torch.tensor([3, 3, 0, 1, 1, 2, 4, 0])
    (everything,) = minibatch_groups(group_ids, 1)
    assert everything.all()
    parts = minibatch_groups(group_ids, 4)
    assert [group_ids[p].tolist() for p in parts] == [[0, 1, 1, 0], [2], [3, 3], [4]]  # groups 0-1, 2, 3, 4, rows in order
    assert len(minibatch_groups(torch.tensor([5, 5]), 8)) == 1  # never more steps than groups
    step = {"pg_loss": 0.5, "grad_norm": 2.0, "update_applied": True, "microbatches": 3, "lr": 1e-3,
            "clip_frac_high": 0.0}
    assert merged_steps([step]) is step
    merged = merged_steps([step, {**step, "pg_loss": 1.5, "clip_frac_high": 0.2, "update_applied": False}])
    assert merged["pg_loss"] == 1.0 and merged["clip_frac_high_per_step"] == [0.0, 0.2]
    assert merged["microbatches"] == 6 and merged["update_applied"] is False and merged["optimizer_steps"] == 2
