"""The megatron policy update against a plain formula on transformers: same loss, same gradients."""

import pytest
import torch

from megatron_mimesis.models.config import ParallelConfig
from megatron_mimesis.rl.types import TrainingRow
from megatron_mimesis.rl.update.policy_step import PolicyLossConfig, plan_microbatches
from megatron_mimesis.rl.update.rows import StepRows
from tests.models.harness import PRESET, build_megatron_from_hf, hf_reference
from tests.multiproc import run_distributed

EPS = 0.2


def _rows(seed=0):
    g = torch.Generator().manual_seed(seed)
    rows = []
    for i, (ctx, resp) in enumerate([(5, 4), (9, 7), (3, 2), (12, 6), (7, 5)]):
        ids = torch.randint(0, PRESET.vocab_size, (ctx + resp,), generator=g).tolist()
        rows.append(TrainingRow(group_id=i // 2, rollout_id=i, context_ids=ids[:ctx], response_ids=ids[ctx:],
                                response_logprobs=[0.0] * resp, reward=0.0, domain="toy"))
    advantages = [1.0, -0.5, 0.8, -1.2, 0.3]
    return rows, advantages


def _with_old_logprobs(model, rows, seed=1):
    """Old log-probs = the model's own, shifted per token, so that ratios leave the clip range on some tokens."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for r in rows:
        ids = torch.tensor([r.context_ids + r.response_ids])
        with torch.no_grad():
            logp = torch.log_softmax(model(ids).logits[0].float(), dim=-1)
        start = len(r.context_ids) - 1
        current = [logp[start + k, t].item() for k, t in enumerate(r.response_ids)]
        shift = (torch.rand(len(current), generator=g) - 0.5).tolist()
        out.append(TrainingRow(**{**r.__dict__, "response_logprobs": [c + s for c, s in zip(current, shift, strict=True)]}))
    return out


def _rollout_weights(rows):
    """Rollout-correction weights as MIS gives them: some tokens rejected (0), the others around 1."""
    weights = []
    for i, r in enumerate(rows):
        weights.append([0.0 if (i + k) % 4 == 0 else 0.6 + 0.1 * k for k in range(len(r.response_ids))])
    return weights


def _reference(model, rows, advantages, weights=None):
    """sum over response tokens of -w min(r A, clip(r) A), divided by the number of response tokens with w != 0
    (w = 1 without weights)."""
    model.zero_grad()
    total, count = 0.0, 0
    for i, (r, a) in enumerate(zip(rows, advantages, strict=True)):
        ids = torch.tensor([r.context_ids + r.response_ids])
        logp = torch.log_softmax(model(ids).logits[0].float(), dim=-1)
        start = len(r.context_ids) - 1
        new = torch.stack([logp[start + k, t] for k, t in enumerate(r.response_ids)])
        ratio = torch.exp(new - torch.tensor(r.response_logprobs))
        w = torch.ones(len(r.response_ids)) if weights is None else torch.tensor(weights[i])
        total = total - (w * torch.minimum(ratio * a, ratio.clamp(1 - EPS, 1 + EPS) * a)).sum()
        count += int((w != 0).sum())
    loss = total / count
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}


def test_a_microbatch_puts_the_loss_on_response_predictions():
    rows = StepRows.of_rows([
        TrainingRow(0, 0, context_ids=[10, 11, 12], response_ids=[13, 14], response_logprobs=[-1.0, -2.0],
                    reward=1.0, domain="x"),
        TrainingRow(1, 1, context_ids=[20], response_ids=[21, 22], response_logprobs=[-3.0, -4.0], reward=0.0,
                    domain="x")], teacher=[[-0.5, -0.6], [-0.7, -0.8]])
    b = {k: v[0].tolist() if isinstance(v, torch.Tensor) and v.dim() == 2 else v
         for k, v in rows.microbatch([1, 0], torch.tensor([0.5, -1.0]), 3, "cpu").items()}
    assert b["tokens"] == [20, 21, 22, 10, 11, 12, 13, 14, 0] and b["labels"] == [21, 22, 0, 11, 12, 13, 14, 0, 0]
    assert b["position_ids"] == [0, 1, 2, 0, 1, 2, 3, 4, 0]
    assert b["loss_mask"] == [1, 1, 0, 0, 0, 1, 1, 0, 0] and b["advantages"] == [-1, -1, 0, 0, 0, 0.5, 0.5, 0, 0]
    assert b["old_logprobs"] == [-3, -4, 0, 0, 0, -1, -2, 0, 0]
    assert b["teacher_logprobs"] == pytest.approx([-0.7, -0.8, 0, 0, 0, -0.5, -0.6, 0, 0])
    assert b["ref_logprobs"] == [0] * 9 and b["rollout_weights"] == [1, 1, 0, 0, 0, 1, 1, 0, 0]
    assert b["cu_seqlens"].tolist() == [0, 3, 8, 9] and b["max_seqlen"] == 5  # one pad token to a multiple of 3


def test_microbatch_plan_is_balanced_bounded_and_equal_in_count():
    plan = plan_microbatches([90, 10, 50, 50, 30, 70], dp_size=2, max_tokens=100)
    assert len(plan[0]) == len(plan[1])
    loads = [sum([90, 10, 50, 50, 30, 70][i] for mb in rank for i in mb) for rank in plan]
    assert abs(loads[0] - loads[1]) <= 10
    assert all(sum([90, 10, 50, 50, 30, 70][i] for i in mb) <= 100 for rank in plan for mb in rank)
    assert sorted(i for rank in plan for mb in rank for i in mb) == list(range(6))
    with pytest.raises(ValueError, match="exceeds max_tokens_per_microbatch"):
        plan_microbatches([101], 1, 100)


def _update_in_layout(rank, world_size, tp, sp, hf_state, rows, advantages, weights):
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from megatron_mimesis.compat import enable_cpu_compat
    from megatron_mimesis.models.hf_weights import gather_hf_tensors
    from megatron_mimesis.rl.update.policy_step import policy_update
    from megatron_mimesis.training.grads import finalize_grads

    enable_cpu_compat()
    parallel_state.initialize_model_parallel(tp, 1)
    model_parallel_cuda_manual_seed(0)
    module, config, provider = build_megatron_from_hf(
        hf_state, ParallelConfig(tensor_model_parallel_size=tp, sequence_parallel=sp), calculate_per_token_loss=True)
    # plain DDP (all-reduced grads on every rank) and no clipping, so that the grads stay comparable after the step
    model = DistributedDataParallel(config=config, ddp_config=DistributedDataParallelConfig(
        grad_reduce_in_fp32=True), module=module)
    config.finalize_model_grads_func = finalize_grads
    optimizer = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=0.0, clip_grad=0.0), [model])
    step = StepRows.of_rows(rows)
    if weights is not None:
        step = step.with_response("rollout_weights", torch.tensor([w for row in weights for w in row],
                                                                  dtype=torch.float64))
    result = policy_update([model], optimizer, step, torch.tensor(advantages),
                           PolicyLossConfig(clip_eps_low=EPS, clip_eps_high=EPS), max_tokens_per_microbatch=24,
                           device=torch.device("cpu"))
    grads = gather_hf_tensors(module, PRESET, provider.padded_vocab_size, grads=True)
    parallel_state.destroy_model_parallel()
    return result, grads


@pytest.mark.slow
@pytest.mark.parametrize(("tp", "sp", "weighted"), [(2, True, True), (1, False, False)],
                         ids=["tp2-sp-rollout-weights", "dp2"])
def test_policy_update_matches_the_formula_on_transformers(tp, sp, weighted):
    hf = hf_reference(seed=7)
    rows, advantages = _rows()
    rows = _with_old_logprobs(hf, rows)
    weights = _rollout_weights(rows) if weighted else None
    ref_loss, ref_grads = _reference(hf, rows, advantages, weights)
    for result, grads in run_distributed(_update_in_layout, 2, tp, sp, hf.state_dict(), rows, advantages, weights):
        assert abs(result["pg_loss"] - ref_loss) <= 1e-5, (result, ref_loss)
        assert result["microbatches"] >= 2 and 0 < result["clip_frac_low"] + result["clip_frac_high"] < 1
        for name, g in ref_grads.items():
            err = (grads[name] - g).abs().max().item()
            assert err <= 1e-5 * max(1.0, g.abs().max().item()), (name, err)
