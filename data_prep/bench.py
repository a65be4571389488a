"""``python -m data_prep.bench``: full-pipeline throughput on the embedded corpus vs the raw tokenizer.

Measured in one run, with the tokenizer of a default mid-training build (cached in ``.cache/data/chitchat-bench``):

* raw: the tokenizer's own batch encode (``encode_batch_fast``) of every turn of the corpus to id lists,
  single-threaded (``TOKENIZERS_PARALLELISM=false``), i.e. one core's worth of pure tokenisation; the Rust encode
  alone, without reading the ids out into Python lists, is printed too;
* pipeline: ``data_prep.midtrain`` end to end (read, validate, tokenise, render, pack, write) with 1 and 2 workers.

Both count the same tokens (those of the turn contents), so the ratios compare like with like; the pipeline's
output tokens (with the template and both speakers' renderings) are printed too. Goals: pipeline(1 worker) >= 50%
of raw, and 2 workers >= 1.7x one worker.

Each figure is the best of ``--repeats`` runs. Wall-clock rates only mean something on otherwise idle cores, so the
CPU seconds (this process plus its worker processes) are reported as well: tokens per CPU-second is the cost per
core, and stays meaningful when other jobs share the machine. The figures also go to ``--output``/bench_data_prep.json
(default under ``runs/``).
"""

import argparse
import json
import os
import resource
import tempfile
import time
from pathlib import Path

from data_prep import midtrain
from data_prep.pipeline import REPO_ROOT, PrepConfig, _record_format
from data_prep.records import RecordError, to_conversation
from data_prep.sources import chitchat_source
from data_prep.tokenizer import TextEncoder

BENCH_CACHE = REPO_ROOT / ".cache" / "data" / "chitchat-bench"  # not the demo's cache: its options differ
DEFAULT_OUTPUT = Path("runs") / "bench-data-prep"


def corpus_texts(max_conversations: int | None) -> list[str]:
    fmt = _record_format(PrepConfig())
    texts = []
    for count, (location, record) in enumerate(chitchat_source().records()):
        if max_conversations is not None and count >= max_conversations:
            break
        try:
            texts += [turn.content for turn in to_conversation(record, location, fmt).turns]
        except RecordError:
            continue
    return texts


def cpu_seconds() -> float:
    """CPU time of this process and of its finished child processes (the pool's workers)."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def timed(run, repeats: int) -> tuple[float, float, object]:
    """Best wall time and best CPU time over ``repeats`` calls, and the last result."""
    walls, cpus = [], []
    for _ in range(repeats):
        wall, cpu = time.perf_counter(), cpu_seconds()
        result = run()
        walls.append(time.perf_counter() - wall)
        cpus.append(cpu_seconds() - cpu)
    return min(walls), min(cpus), result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m data_prep.bench", description=__doc__.splitlines()[0])
    parser.add_argument("--max-conversations", type=int, help="bench on the first N conversations only")
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2], help="worker counts to measure")
    parser.add_argument("--tokenizer", type=Path,
                        help="tokenizer directory to use (default: the one a default mid-training build trains)")
    parser.add_argument("--repeats", type=int, default=3, help="runs per figure; the best is reported")
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT, help="directory for bench_data_prep.json")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error(f"--repeats must be at least 1, got {args.repeats}")

    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    # imported here, before the clock starts, and not at module level: spawned workers re-import this module
    import megatron.core.datasets.indexed_dataset  # noqa: F401

    tokenizer_dir = args.tokenizer or midtrain.build(output=str(BENCH_CACHE), progress=False).output_dir / "tokenizer"
    encoder = TextEncoder(tokenizer_dir)
    texts = corpus_texts(args.max_conversations)
    wall, cpu, ids = timed(lambda: encoder.encode_batch(texts), args.repeats)
    raw_tokens = sum(map(len, ids))
    raw_rate, raw_per_cpu = raw_tokens / wall, raw_tokens / cpu
    print(
        f"raw encode_batch -> ids, 1 thread: {raw_tokens:,} tokens, {raw_rate:,.0f} tokens/s, "
        f"{raw_per_cpu:,.0f} tokens/CPU-s"
    )
    wall, _, _ = timed(lambda: encoder.tokenizer.encode_batch_fast(texts, add_special_tokens=False), args.repeats)
    rust_rate = raw_tokens / wall
    print(f"  (Rust encode alone, ids not read out: {rust_rate:,.0f} tokens/s)")
    results = {"tokenizer": str(tokenizer_dir), "max_conversations": args.max_conversations, "repeats": args.repeats,
               "raw": {"tokens": raw_tokens, "tokens_per_s": raw_rate, "tokens_per_cpu_s": raw_per_cpu,
                       "rust_encode_tokens_per_s": rust_rate},
               "pipeline": []}

    first = None
    for workers in args.workers:

        def run(workers=workers):
            with tempfile.TemporaryDirectory() as output:
                return midtrain.build(
                    output=output,
                    tokenizer=str(tokenizer_dir),
                    workers=workers,
                    max_conversations=args.max_conversations,
                    progress=False,
                )

        wall, cpu, result = timed(run, args.repeats)
        corpus = result.manifest["corpora"]["chitchat"]
        rate, per_cpu = corpus["content_tokens"] / wall, corpus["content_tokens"] / cpu
        first = first or (rate, per_cpu)
        print(
            f"pipeline, {workers} worker(s): {wall:.2f} s wall, {cpu:.2f} CPU-s | "
            f"{rate:,.0f} tokens/s ({rate / raw_rate:.2f}x raw, {rate / first[0]:.2f}x {args.workers[0]} worker) | "
            f"{per_cpu:,.0f} tokens/CPU-s ({per_cpu / raw_per_cpu:.2f}x raw, "
            f"{per_cpu / first[1]:.2f}x {args.workers[0]} worker) | "
            f"{sum(corpus['tokens'].values()) / wall:,.0f} output tokens/s"
        )
        results["pipeline"].append({"workers": workers, "wall_s": wall, "cpu_s": cpu, "tokens_per_s": rate,
                                    "tokens_per_cpu_s": per_cpu, "vs_raw": rate / raw_rate,
                                    "output_tokens_per_s": sum(corpus["tokens"].values()) / wall})
    args.output.mkdir(parents=True, exist_ok=True)
    (args.output / "bench_data_prep.json").write_text(json.dumps(results, indent=2))
    print(f"wrote {args.output / 'bench_data_prep.json'}")


if __name__ == "__main__":
    main()
