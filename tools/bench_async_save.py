"""How long a training step is blocked by a checkpoint save: the synchronous save (the whole write in the rank) vs
the asynchronous one (the rank copies its state to host memory and a forked writer does the rest), both through the
trainer's own save request (``checkpoint/writer.save_request``, megatron-core's torch_dist strategy).

    python tools/bench_async_save.py [--params 1e9] [--dtype bf16] [--output DIR]

Two states, each saved once per way in a world of one gloo process into a fresh directory under ``--output``:
the demo model's checkpoint state (the tiny preset at the demo's vocabulary: its weights and, per parameter, the
fp32 main copy and Adam's two moments, as the trainer saves them) and a synthetic state of ``--params`` parameters
in ``--dtype`` (weights only, in 64M-element tensors). Per state and way: the time the save call blocks, the time
until the checkpoint is fully written, and the blocking ratio async / sync. The figures depend on the disk, the CPU
and the load of the machine: run it on a quiet one. Results go to ``--output``/bench_async_save.json.
"""

import argparse
import json
import shutil
import time
from pathlib import Path

import torch

from megatron_mimesis.gloo import run_gloo_processes

DEFAULT_OUTPUT = Path("runs") / "bench-async-save"
CHUNK = 64 * 2**20  # elements per synthetic tensor
WAYS = ("sync", "async")
DEMO_VOCAB = 8192  # launch/configs/demo_midtrain.yaml


def _demo_state() -> dict[str, torch.Tensor]:
    from megatron_mimesis.models.presets import get_preset

    preset = get_preset("tiny").replace(vocab_size=DEMO_VOCAB)
    model = preset.family.hf_model(preset)
    state = {}
    for name, p in model.named_parameters():
        state[name] = p.detach().float()
        for part in ("main", "exp_avg", "exp_avg_sq"):
            state[f"optimizer.{part}.{name}"] = torch.randn_like(p, dtype=torch.float32)
    return state


def _synthetic_state(params: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    sizes = [CHUNK] * (params // CHUNK) + ([params % CHUNK] if params % CHUNK else [])
    return {f"weight.{i}": torch.randn(n, dtype=torch.float32).to(dtype) for i, n in enumerate(sizes)}


def _save_both_ways(rank, world_size, params: int | None, dtype: torch.dtype, directory: str) -> dict:
    """Both saves of the demo state (``params`` None) or of the synthetic one, built here: the rank holds it once."""
    from megatron.core.dist_checkpointing import ShardedTensor
    from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

    from megatron_mimesis.checkpoint.writer import save_request
    from megatron_mimesis.compat import enable_cpu_compat

    enable_cpu_compat(announce=False)  # a no-op where CUDA is usable
    tensors = _demo_state() if params is None else _synthetic_state(params, dtype)
    results = {"bytes": sum(t.numel() * t.element_size() for t in tensors.values())}
    for way in WAYS:
        target = Path(directory) / way
        shutil.rmtree(target, ignore_errors=True)
        target.mkdir(parents=True)
        state = {k: ShardedTensor.from_rank_offsets(k, t, replica_id=0) for k, t in tensors.items()}
        queue = AsyncCallsQueue() if way == "async" else None
        start = time.perf_counter()
        request = save_request(state, target, forked=queue is not None)
        if queue is None:
            request.execute_sync()
        else:
            queue.schedule_async_request(request)
        blocked = time.perf_counter() - start
        if queue is not None:
            queue.maybe_finalize_async_calls(blocking=True)
            queue.close()
        written = time.perf_counter() - start
        results[way] = {"blocked_s": blocked, "written_s": written}
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--params", type=float, default=1e9, help="parameters of the synthetic state")
    parser.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT)
    args = parser.parse_args(argv)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    args.output.mkdir(parents=True, exist_ok=True)
    report = {}
    for name, params in (("demo model", None), (f"synthetic {args.params:.3g} params {args.dtype}", int(args.params))):
        (ways,) = run_gloo_processes(_save_both_ways, 1, params, dtype, str(args.output / "checkpoints"))
        report[name] = {**ways, "blocked_ratio": ways["async"]["blocked_s"] / ways["sync"]["blocked_s"]}
    shutil.rmtree(args.output / "checkpoints", ignore_errors=True)
    print(f"{'state':<34}{'GiB':>7}{'sync blocks (s)':>17}{'async blocks (s)':>18}{'x sync':>8}{'async written (s)':>19}")
    for name, r in report.items():
        print(f"{name:<34}{r['bytes'] / 2**30:>7.2f}{r['sync']['blocked_s']:>17.2f}{r['async']['blocked_s']:>18.2f}"
              f"{r['blocked_ratio']:>8.3f}{r['async']['written_s']:>19.2f}")
    (args.output / "bench_async_save.json").write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
