"""Rollout correction of a step's rows: per-token importance weights from the engine's to the trainer's
distribution, the mismatch metrics, and the warning when the correction acts on too many tokens.

The rows carry both log-probs of every sampled token (``TrainingRow.response_logprobs``, the trainer's, and
``engine_logprobs``, the sampler's; see ``scoring.recompute_old_logprobs``), as the step's tensors
(``rows.StepRows``); the weights are :func:`~megatron_mimesis.kernels.reference.rollout_correction_weights` of the
two, one per response token, and go into the policy loss as a per-token multiplier (``policy_step``). Rows sampled by the training model itself carry no engine
log-probs: then there is nothing to correct, no weight is computed and the loss is the uncorrected one.
"""

import torch

from megatron_mimesis.kernels.reference import rollout_correction_weights
from megatron_mimesis.rl.update.rows import StepRows


def correction(trainer: list[list[float]], engine: list[list[float]], mode: str, level: str, cap: float
               ) -> tuple[list[list[float]], dict]:
    """Per-row token weights and the metrics over all tokens (plain floats) from per-row log-probs of the same
    sampled tokens under the trainer and the engine."""
    lengths = [len(row) for row in trainer]
    weights, metrics = rollout_correction_weights(
        torch.tensor([lp for row in trainer for lp in row], dtype=torch.float64),
        torch.tensor([lp for row in engine for lp in row], dtype=torch.float64),
        torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths, dtype=torch.long)),
        mode=mode, level=level, cap=cap)
    flat, per_row, start = weights.tolist(), [], 0
    for n in lengths:
        per_row.append(flat[start:start + n])
        start += n
    return per_row, {name: value.item() for name, value in metrics.items()}


def rollout_weights(rows: StepRows, mode: str, level: str, cap: float) -> tuple[torch.Tensor | None, dict]:
    """The weight of each of the step's response tokens, [S] (None when no row has engine log-probs, or ``mode`` is
    "off"), and the metrics over all of them (``engine_kl``, ``engine_logprob_abs_diff[_max]``, ``is_*``)."""
    if "engine_logprobs" not in rows.response:
        return None, {}
    weights, metrics = rollout_correction_weights(rows.response["old_logprobs"], rows.response["engine_logprobs"],
                                                  rows.response_row_index(), mode=mode, level=level, cap=cap)
    return (None if mode == "off" else weights), {name: value.item() for name, value in metrics.items()}


def correction_warning(record: dict, mode: str, cap: float, warn_frac: float) -> str | None:
    """One line when the share of tokens truncated (tis) or masked (mis) in ``record`` passes ``warn_frac``: the
    engine and the trainer disagree more than numerics explain (a failed weight sync, a precision setting), or, with
    stale rows (a rollout worker ahead of the trainer), the policy moved more between versions than the cap allows."""
    share = record.get("is_truncated_frac" if mode == "tis" else "is_masked_frac")
    if share is None or share <= warn_frac:
        return None
    action = f"truncated (trainer/engine ratio above {cap:g})" if mode == "tis" else \
        f"masked (trainer/engine ratio outside [{1 / cap:.3g}, {cap:g}])"
    stale = record.get("staleness_mean")
    advice = (f"rows were sampled {stale:.2g} policy versions behind on average: lower max_staleness or the learning "
              f"rate" if stale else "check the weight sync and engine_deltanet_state_dtype")
    return (f"rollout correction: {share:.1%} of sampled tokens {action}, above rollout_correction_warn_frac "
            f"{warn_frac:.1%}; engine_kl {record['engine_kl']:.3g}, max |delta| "
            f"{record['engine_logprob_abs_diff_max']:.3g}: {advice}")
