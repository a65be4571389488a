"""Host work of one RL step's rows: from each data-parallel rank's own rows to this rank's micro-batches, the way the
update used to do it (the baseline: every rank's rows pickled through ``all_gather_object``, then per-token Python
lists of every row) and the way it does now (``rl/update/rows.StepRows``: four tensors all-gathered, micro-batches
cut from them).

    python tools/bench/bench_rl_rows.py [--tokens 2e6] [--ranks 2] [--row-tokens 2048] [--output DIR]

Each way runs in a fresh world of ``--ranks`` gloo processes on this machine, each rank holding its share of
synthetic rows (a context, a response of a quarter of the row, old and engine log-probs and a CSD teacher's per
response token). Per way it reports the wall time of the slowest rank and the peak host memory a rank added, and
the ratios to the baseline. The figures depend on the CPU and on the load of the machine: run it on a quiet one.
Results go to ``--output``/bench_rl_rows.json.
"""

import argparse
import json
import resource
import time
from pathlib import Path

import psutil
import torch
import torch.distributed as dist

from megatron_mimesis.gloo import run_gloo_processes
from megatron_mimesis.rl.types import TrainingRow
from megatron_mimesis.rl.update.policy_step import plan_microbatches
from megatron_mimesis.rl.update.rollout_correction import correction, rollout_weights
from megatron_mimesis.rl.update.rows import INTEGER_FIELDS, TOKEN_FIELDS, StepRows

DEFAULT_OUTPUT = Path("runs") / "bench-rl-rows"
RESPONSE_SHARE = 0.25
MAX_TOKENS_PER_MICROBATCH = 32768
WAYS = ("python-objects", "tensors")


def _rows(rank: int, ranks: int, tokens: int, row_tokens: int) -> tuple[list[TrainingRow], list[list[float]]]:
    g = torch.Generator().manual_seed(rank)
    rows, teacher = [], []
    for i in range(tokens // row_tokens // ranks):
        response = int(row_tokens * RESPONSE_SHARE)
        ids = torch.randint(0, 248_320, (row_tokens,), generator=g).tolist()
        old = (-torch.rand(response, generator=g, dtype=torch.float64)).tolist()
        rows.append(TrainingRow(i // 8 + rank * 1000, i + rank * 100_000, ids[:-response], ids[-response:], old,
                                reward=float(i % 3), domain="d", engine_logprobs=[x - 1e-3 for x in old]))
        teacher.append([x - 0.1 for x in old])
    return rows, teacher


def _baseline_sample(row: TrainingRow, advantage: float, teacher: list[float], weights: list[float]) -> dict:
    """The update's per-row arrays before rows became tensors (policy_step.row_sample of issue 22's code)."""
    tokens = row.context_ids + row.response_ids
    n, start = len(tokens), len(row.context_ids) - 1
    mask, old, adv, teach, ref, weight = ([0.0] * n for _ in range(6))
    for k, logprob in enumerate(row.response_logprobs):
        old[start + k], adv[start + k], weight[start + k] = logprob, advantage, weights[k]
        mask[start + k], teach[start + k] = float(weights[k] != 0.0), teacher[k]
    return {"tokens": tokens, "labels": tokens[1:] + [0], "loss_mask": mask, "old_logprobs": old, "advantages": adv,
            "teacher_logprobs": teach, "ref_logprobs": ref, "rollout_weights": weight, "position_ids": list(range(n))}


def _baseline(rows, teacher, dp_rank, dp_size):
    gathered = [None] * dp_size
    dist.all_gather_object(gathered, (rows, teacher))
    rows = [r for part, _ in gathered for r in part]
    teacher = [t for _, part in gathered for t in part]
    weights, _ = correction([r.response_logprobs for r in rows], [r.engine_logprobs for r in rows], "tis", "token", 2.0)
    samples = [_baseline_sample(r, 0.5, t, w) for r, t, w in zip(rows, teacher, weights, strict=True)]
    plan = plan_microbatches([len(s["tokens"]) for s in samples], dp_size, MAX_TOKENS_PER_MICROBATCH)
    return [{name: torch.tensor([v for i in mb for v in samples[i][name]],
                                dtype=torch.long if name in INTEGER_FIELDS else torch.float32)
             for name in TOKEN_FIELDS} for mb in plan[dp_rank]]


def _tensors(rows, teacher, dp_rank, dp_size):
    step = StepRows.of_rows(rows, teacher).gathered(dist.group.WORLD, torch.device("cpu"))
    weights, _ = rollout_weights(step, "tis", "token", 2.0)
    step = step.with_response("rollout_weights", weights)
    plan = plan_microbatches(step.lengths.tolist(), dp_size, MAX_TOKENS_PER_MICROBATCH)
    advantages = torch.full((len(step),), 0.5)
    return [step.microbatch(mb, advantages, 1, torch.device("cpu")) for mb in plan[dp_rank]]


def _run(rank: int, world_size: int, way: str, tokens: int, row_tokens: int) -> dict:
    rows, teacher = _rows(rank, world_size, tokens, row_tokens)
    rss_before = psutil.Process().memory_info().rss
    dist.barrier()
    start = time.perf_counter()
    batches = (_baseline if way == "python-objects" else _tensors)(rows, teacher, rank, world_size)
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"seconds": seconds, "peak_added_bytes": max(peak - rss_before, 0),
            "microbatch_tokens": sum(int(b["tokens"].numel()) for b in batches)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=float, default=2e6, help="tokens of the step's rows, all ranks together")
    parser.add_argument("--ranks", type=int, default=2, help="data-parallel ranks (gloo processes)")
    parser.add_argument("--row-tokens", type=int, default=2048, help="tokens per row (context + response)")
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT)
    args = parser.parse_args(argv)
    results = {}
    for way in WAYS:
        per_rank = run_gloo_processes(_run, args.ranks, way, int(args.tokens), args.row_tokens)
        results[way] = {"seconds": max(r["seconds"] for r in per_rank),
                        "peak_added_gib": max(r["peak_added_bytes"] for r in per_rank) / 2**30,
                        "microbatch_tokens": sum(r["microbatch_tokens"] for r in per_rank)}
    base = results["python-objects"]
    print(f"{int(args.tokens):,} tokens in rows of {args.row_tokens} over {args.ranks} data-parallel ranks")
    print(f"{'way':<16}{'time (s)':>10}{'x base':>8}{'peak host (GiB/rank)':>22}{'x base':>8}")
    for way, r in results.items():
        print(f"{way:<16}{r['seconds']:>10.2f}{r['seconds'] / base['seconds']:>8.3f}{r['peak_added_gib']:>22.3f}"
              f"{r['peak_added_gib'] / max(base['peak_added_gib'], 1e-9):>8.3f}")
    args.output.mkdir(parents=True, exist_ok=True)
    (args.output / "bench_rl_rows.json").write_text(json.dumps(
        {"tokens": int(args.tokens), "ranks": args.ranks, "row_tokens": args.row_tokens, "results": results}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
