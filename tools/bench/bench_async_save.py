"""How long a training step is blocked by a checkpoint save, how much each rank writes and how much host memory the
save takes it: the trainer's state (a model and megatron's distributed optimizer, data parallel over ``--ranks``
gloo processes) saved three ways, each through the trainer's own save request (``checkpoint/writer.save_request``).

    python tools/bench/bench_async_save.py [--ranks 2] [--hidden 512] [--ffn 2048] [--vocab 8192] [--output DIR]

* ``sync``: megatron's ``fully_reshardable`` optimizer state through its plain torch_dist strategy, written in the
  step: the save this project made before its saves were fully parallel (every rank all-gathers its tensor-parallel
  shard's whole optimizer state; data-parallel rank 0 writes it and every weight);
* ``async``: the same, written by a writer forked from each rank while training would go on;
* ``parallel``: the trainer's save now: each rank writes its own optimizer shard and its share of the weights
  (``checkpoint/optimizer_state.py``, megatron's fully parallel save wrapper), in a forked writer.

Per way and rank: the time the save call blocks, the time until the checkpoint is written, the bytes of the
checkpoint in that rank's files (all, and the optimizer's), and the rank's peak resident memory during the save
above what it held before (the forked writer's own memory not included). The model is the tiny preset widened by
the flags (fp32, so the optimizer state is 12 bytes per parameter: fp32 weights, Adam's two moments); the
optimizer state is random. Figures depend on the disk, the CPU and the load of the machine: run it on a quiet one.
Results go to ``--output``/bench_async_save.json; the checkpoints are removed.
"""

import argparse
import json
import re
import shutil
import time
from collections import Counter
from pathlib import Path

import torch

from megatron_mimesis.gloo import run_gloo_processes

DEFAULT_OUTPUT = Path("runs") / "bench-async-save"
WAYS = ("sync", "async", "parallel")
FORMER_METADATA = {"distrib_optim_sharding_type": "fully_reshardable"}


def _memory_kib(field: str) -> int:
    return int(re.search(rf"^{field}:\s+(\d+) kB", Path("/proc/self/status").read_text(), re.M)[1])


def _reset_peak_memory() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM back to the current RSS (Linux >= 4.0)


def _random_adam_state(optimizer, seed: int) -> None:
    from megatron_mimesis.checkpoint import trainer_state

    trainer_state._prepare_adam_for_load(optimizer)  # an Adam state to save without training a step
    generator = torch.Generator().manual_seed(seed)
    for inner in trainer_state._inner_torch_optimizers(optimizer):
        for state in inner.state.values():
            for name in ("exp_avg", "exp_avg_sq"):
                state[name].copy_(torch.rand(state[name].shape, generator=generator))


def former_state(trainer) -> dict:
    """The trainer's checkpoint state as this project saved it before its saves were fully parallel: the optimizer
    state ``fully_reshardable``."""
    from megatron_mimesis.checkpoint import trainer_state

    state = trainer_state._sharded_state_dict(trainer.model, trainer.optimizer, trainer.scheduler, {},
                                              is_loading=False, rng=True)
    model_sd = {k: v for chunk_sd in trainer_state._model_state(trainer.model).values() for k, v in chunk_sd.items()}
    state["optimizer"] = trainer.optimizer.sharded_state_dict(model_sd, metadata=FORMER_METADATA)
    return state


def _state(trainer, way: str) -> dict:
    from megatron_mimesis.checkpoint import trainer_state

    if way == "parallel":
        return trainer_state._sharded_state_dict(trainer.model, trainer.optimizer, trainer.scheduler, {},
                                                 is_loading=False, rng=True)
    return former_state(trainer)


def _save_three_ways(rank, world_size, overrides: dict, directory: str) -> dict:
    """Each way's save of one trainer's state, built here, measured on this rank."""
    import torch.distributed as dist
    from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

    from megatron_mimesis.checkpoint import trainer_state
    from megatron_mimesis.checkpoint.writer import save_request
    from megatron_mimesis.compat import enable_cpu_compat
    from megatron_mimesis.training.config import TrainConfig
    from megatron_mimesis.training.train import Trainer

    enable_cpu_compat(announce=False)  # a no-op where CUDA is usable
    trainer = Trainer(TrainConfig(model_overrides=overrides), tokenizer_dir=None)
    _random_adam_state(trainer.optimizer, seed=rank)
    results = {"parameters": sum(p.numel() for chunk in trainer.model for p in chunk.parameters())}
    for way in WAYS:
        target = Path(directory) / way
        if rank == 0:
            shutil.rmtree(target, ignore_errors=True)
            target.mkdir(parents=True)
        dist.barrier()
        queue = None if way == "sync" else AsyncCallsQueue()
        group = trainer_state._data_parallel_group() if way == "parallel" else None
        before = _memory_kib("VmRSS")
        _reset_peak_memory()
        start = time.perf_counter()
        request = save_request(_state(trainer, way), target, forked=queue is not None, parallel_group=group)
        if queue is None:
            request.execute_sync()
        else:
            queue.schedule_async_request(request)
        blocked = time.perf_counter() - start
        if queue is not None:
            queue.maybe_finalize_async_calls(blocking=True)
            queue.close()
        written = time.perf_counter() - start
        results[way] = {"blocked_s": blocked, "written_s": written,
                        "peak_rss_above_start_gib": (_memory_kib("VmHWM") - before) / 2**20}
    return results


def _bytes_by_rank(directory: Path) -> tuple[Counter, Counter]:
    """Bytes of the checkpoint in each rank's files (torch DCP names them ``__{rank}_{n}.distcp``): all, optimizer."""
    from torch.distributed.checkpoint import FileSystemReader

    from megatron_mimesis.checkpoint import reader  # noqa: F401  (installs the restricted reader)

    written, optimizer = Counter(), Counter()
    for index, info in FileSystemReader(str(directory)).read_metadata().storage_data.items():
        rank = int(re.match(r"__(\d+)_", info.relative_path)[1])
        written[rank] += info.length
        if index.fqn.startswith("optimizer."):
            optimizer[rank] += info.length
    return written, optimizer


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=2, help="data-parallel ranks (gloo processes)")
    parser.add_argument("--hidden", type=int, default=512, help="hidden size of the widened tiny model")
    parser.add_argument("--ffn", type=int, default=2048, help="FFN size of the widened tiny model")
    parser.add_argument("--vocab", type=int, default=8192, help="vocabulary of the widened tiny model")
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT)
    args = parser.parse_args(argv)
    args.output.mkdir(parents=True, exist_ok=True)
    overrides = {"hidden_size": args.hidden, "ffn_hidden_size": args.ffn, "vocab_size": args.vocab}
    checkpoints = args.output / "checkpoints"
    ranks = run_gloo_processes(_save_three_ways, args.ranks, overrides, str(checkpoints))
    report = {"ranks": args.ranks, "model_overrides": overrides, "parameters": ranks[0]["parameters"], "ways": {}}
    for way in WAYS:
        written, optimizer = _bytes_by_rank(checkpoints / way)
        report["ways"][way] = [{**r[way], "written_bytes": written[rank], "optimizer_bytes": optimizer[rank]}
                               for rank, r in enumerate(ranks)]
    shutil.rmtree(checkpoints, ignore_errors=True)
    sync_blocked = max(r["blocked_s"] for r in report["ways"]["sync"])
    print(f"{report['parameters'] / 1e6:.1f}M parameters, fp32, distributed optimizer over {args.ranks} ranks")
    print(f"{'way':<10}{'rank':>5}{'blocks (s)':>12}{'x sync':>8}{'written (s)':>13}{'MiB written':>13}"
          f"{'optimizer MiB':>15}{'peak RSS +GiB':>15}")
    for way, rows in report["ways"].items():
        for rank, r in enumerate(rows):
            print(f"{way:<10}{rank:>5}{r['blocked_s']:>12.2f}{r['blocked_s'] / sync_blocked:>8.3f}"
                  f"{r['written_s']:>13.2f}{r['written_bytes'] / 2**20:>13.1f}{r['optimizer_bytes'] / 2**20:>15.1f}"
                  f"{r['peak_rss_above_start_gib']:>15.3f}")
    (args.output / "bench_async_save.json").write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
