"""Rollout engines side by side on this machine: weight-sync time and rollout tokens/s of one model through the
colocated vLLM engine vs the local megatron engine (the baseline), and how closely vLLM's log-probs of its own
samples match the trainer's.

    python tools/bench/bench_engines.py [--preset tiny] [--prompts 8] [--prompt-tokens 16] [--new-tokens 64]
        [--repeats 3] [--engine-options JSON] [--output DIR]

Runs in one process (a gloo world of one, TP=1, bf16), in the vLLM environment (``make venv-vllm``). Both
engines get their weights the way RL syncs them (``sync_weights`` from a trainer model, the local engine into a
model copy of its own) and sample the same prompts; times are medians over ``--repeats`` after one warm-up call.
The weights are random: their values do not matter for speed, and the sampled tokens are scored by both.
Prints a table with the ratios to the local engine measured in the same run and writes ``--output``/bench_engines.json
(default under ``runs/``).
"""

import argparse
import json
import os
import socket
import statistics
import time
from pathlib import Path

import torch

from megatron_mimesis.models.presets import get_preset
from megatron_mimesis.rl.engines.vllm import CPU_TINY_OPTIONS

DEFAULT_OUTPUT = Path("runs") / "bench-engines"


class _IdsOnly:
    """Stands in for a tokenizer's ``decode``: both engines make the same call, and text is not measured."""

    def decode(self, ids, skip_special_tokens=False):
        return ""


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--prompts", type=int, default=8, help="prompts per generate call")
    parser.add_argument("--prompt-tokens", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=64, help="tokens sampled per prompt")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--engine-options", type=json.loads, default=CPU_TINY_OPTIONS,
                        help="vLLM engine keyword arguments (default: the CPU ones the tests use)")
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT, help="directory for bench_engines.json")
    return parser.parse_args(argv)


def _median_time(fn, repeats):
    fn()  # warm-up: first-call allocations and compilation are not the steady state
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from megatron_mimesis.compat import compute_device, enable_cpu_compat
    from megatron_mimesis.models.config import ParallelConfig, transformer_config
    from megatron_mimesis.models.provider import ModelProvider
    from megatron_mimesis.rl.engines.local import LocalEngine
    from megatron_mimesis.rl.engines.vllm import VLLMEngine
    from megatron_mimesis.rl.engines.weight_sync import sync_weights
    from megatron_mimesis.rl.types import SamplingParams
    from megatron_mimesis.rl.update.scoring import score_rows

    # a world of one, set up as torchrun would (vLLM's external_launcher reads these too), on a free port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for key, value in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", str(port)), ("RANK", "0"), ("LOCAL_RANK", "0"),
                       ("WORLD_SIZE", "1")):
        os.environ.setdefault(key, value)
    cpu = enable_cpu_compat()
    dist.init_process_group("gloo" if cpu else "nccl", rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1)
    model_parallel_cuda_manual_seed(0)
    device = compute_device()
    preset = get_preset(args.preset)
    provider = ModelProvider(preset, transformer_config(preset, ParallelConfig(), params_dtype=torch.bfloat16))
    trainer_model, engine_copy = provider().to(device), provider().to(device)
    padded = provider.padded_vocab_size

    local = LocalEngine(engine_copy, _IdsOnly(), device)
    vllm_engine = VLLMEngine(preset, _IdsOnly(), 1, {"seed": 0, **args.engine_options})
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, preset.vocab_size, (args.prompts, args.prompt_tokens), generator=g).tolist()
    sampling = SamplingParams(max_new_tokens=args.new_tokens, temperature=1.0, seed=0)
    results = {"preset": args.preset, "prompts": args.prompts, "prompt_tokens": args.prompt_tokens,
               "new_tokens": args.new_tokens, "repeats": args.repeats, "engines": {}}
    for name, engine in (("local", local), ("vllm", vllm_engine)):
        sync_s = _median_time(lambda e=engine: sync_weights(e, [trainer_model], preset, padded), args.repeats)
        generations = []
        rollout_s = _median_time(lambda e=engine, out=generations: out.append(e.generate(prompts, sampling)),
                                 args.repeats)
        tokens = sum(len(g.token_ids) for g in generations[-1])
        trainer = score_rows([trainer_model], [(p, g.token_ids) for p, g in zip(prompts, generations[-1],
                                                                                strict=True)], 32768, device)
        diffs = [abs(t - e) for row, g in zip(trainer, generations[-1], strict=True)
                 for t, e in zip(row, g.logprobs, strict=True)]
        results["engines"][name] = {"weight_sync_s": sync_s, "rollout_s": rollout_s, "tokens": tokens,
                                    "rollout_tokens_per_s": tokens / rollout_s,
                                    "logprob_abs_diff_mean": sum(diffs) / len(diffs), "logprob_abs_diff_max": max(diffs)}
    base = results["engines"]["local"]
    print(f"{'engine':8} {'sync s':>9} {'x local':>8} {'tokens/s':>10} {'x local':>8} {'|dlogp| mean':>13} {'max':>8}")
    for name, r in results["engines"].items():
        print(f"{name:8} {r['weight_sync_s']:9.4f} {r['weight_sync_s'] / base['weight_sync_s']:8.2f} "
              f"{r['rollout_tokens_per_s']:10.1f} {r['rollout_tokens_per_s'] / base['rollout_tokens_per_s']:8.2f} "
              f"{r['logprob_abs_diff_mean']:13.2e} {r['logprob_abs_diff_max']:8.2e}")
    args.output.mkdir(parents=True, exist_ok=True)
    (args.output / "bench_engines.json").write_text(json.dumps(results, indent=2))
    print(f"wrote {args.output / 'bench_engines.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
