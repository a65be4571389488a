"""Agent evaluation through transformers (the baseline) vs through a vLLM server of the same export: episodes per
minute of ``tools/eval_agent.py`` on the same tasks, users and settings, measured in one run.

    python tools/bench/bench_eval_agent.py --export DIR --tokenizer DIR --definition launch/pipelines/demo.yaml
        [--server-stage simulator_server] [--eval-args "..."] [--output DIR]

The server is started the way the pipeline starts a serve stage of ``--definition`` (its python and its vLLM
flags: ``--server-stage``), on the agent export; eval_agent then plays the agent through its endpoint, which batches
the episodes of a chunk, where an ``hf:`` agent decodes in this machine's transformers. Both runs get ``--eval-args``
(default: the demo pipeline's agent evaluation, on more tasks). Prints the table and writes bench_eval_agent.json
to ``--output`` (default under ``runs/``).
"""

import argparse
import json
import shlex
import subprocess
import sys
import time
from pathlib import Path

from megatron_mimesis.pipeline import definition
from megatron_mimesis.pipeline.processes import Child, free_port, wait_ready
from megatron_mimesis.pipeline.stages import Output, serve_command

REPO = Path(__file__).resolve().parents[2]
DEFAULT_EVAL_ARGS = ("--env toy --env-options '{\"num_tasks\": 512, \"max_words\": 3}' --trials 2 --max-agent-turns 3 "
                     "--max-new-tokens 10 --no-agent-thinking --user scripted=scripted:toy --seed 0")
SERVED_NAME = "bench-agent"


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--export", type=Path, required=True, help="the agent's HF export")
    parser.add_argument("--tokenizer", type=Path, required=True, help="its tokenizer directory")
    parser.add_argument("--definition", type=Path, default=REPO / "launch" / "pipelines" / "demo.yaml")
    parser.add_argument("--server-stage", default="simulator_server",
                        help="the serve stage of --definition whose python and flags start the server")
    parser.add_argument("--eval-args", default=DEFAULT_EVAL_ARGS, help="eval_agent flags for both runs")
    parser.add_argument("--output", type=Path, default=Path("runs") / "bench-eval-agent")
    return parser.parse_args(argv)


def timed_eval(agent: str, tokenizer: Path, eval_args: list[str], output: Path) -> dict:
    argv = [sys.executable, str(REPO / "tools" / "eval_agent.py"), "--agent", agent, "--tokenizer", str(tokenizer),
            *eval_args, "--output", str(output), "--overwrite", "--no-progress"]
    start = time.perf_counter()
    subprocess.run(argv, check=True, stdout=subprocess.DEVNULL)
    wall = time.perf_counter() - start
    pair = json.loads((output / "results.json").read_text())["pairs"][0]
    return {"agent": agent, "episodes": pair["n_episodes"], "wall_s": round(wall, 1),
            "episodes_per_min": round(60 * pair["n_episodes"] / wall, 1), "score": pair["score"]}


def main(argv=None) -> int:
    args = parse_args(argv)
    stage = definition.load(args.definition).stages[args.server_stage]
    eval_args = shlex.split(args.eval_args)
    args.output.mkdir(parents=True, exist_ok=True)
    rows = [timed_eval(f"agent=hf:{args.export}", args.tokenizer, eval_args, args.output / "hf")]
    port = free_port()
    url = f"http://127.0.0.1:{port}/v1"
    python = Path(stage.fields.get("python") or sys.executable)  # a definition's paths are the checkout's
    served = definition.Stage(stage.name, "serve", {**stage.fields, "name": SERVED_NAME,
                                                    "python": str(python if python.is_absolute() else REPO / python)},
                              stage.where)
    server = Child(serve_command(served, Output("hf", args.export), "127.0.0.1", port), {}, args.output / "server.log",
                   30)
    try:
        started = time.perf_counter()
        wait_ready(url, SERVED_NAME, 600, server, what="the agent's vLLM server")
        ready_s = round(time.perf_counter() - started, 1)
        rows.append({**timed_eval(f"agent=openai:{url}@{SERVED_NAME}", args.tokenizer, eval_args,
                                  args.output / "vllm"), "server_ready_s": ready_s})
    finally:
        server.stop()
    rows[1]["vs_hf"] = round(rows[1]["episodes_per_min"] / rows[0]["episodes_per_min"], 2)
    print("| agent | episodes | wall s | episodes/min | vs hf | score |\n|---|---:|---:|---:|---:|---:|")
    for row in rows:
        print(f"| {row['agent'].split('=', 1)[1].split(':')[0]} | {row['episodes']} | {row['wall_s']} | "
              f"{row['episodes_per_min']} | {row.get('vs_hf', 1.0)} | {row['score']} |")
    (args.output / "bench_eval_agent.json").write_text(json.dumps({"eval_args": eval_args, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
