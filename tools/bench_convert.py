"""Conversion benchmark: wall time and peak RSS of import (HF -> dist checkpoint) and export (-> HF) on a
synthetic checkpoint of about 1B parameters (Qwen3.5-4B widths and vocabulary, 4 layers, bf16).

    python tools/bench_convert.py [--layers 4] [--workdir DIR] [--json OUT]

Each phase runs as its own process (the CLI users run); peak RSS is sampled over that process and its
children. The synthetic weights are random; their values do not matter for speed or memory.
"""

import argparse
import json
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil
import torch

from megatron_mimesis.models.hf_io import ShardedSafetensorsWriter
from megatron_mimesis.models.presets import get_preset

REPO = Path(__file__).resolve().parents[1]


def write_synthetic_hf(directory: Path, layers: int) -> int:
    from transformers import Qwen3_5ForCausalLM

    preset = get_preset("4b").replace(num_layers=layers)
    config = preset.to_hf_config(architectures=["Qwen3_5ForCausalLM"], dtype="bfloat16")
    with torch.device("meta"):
        shapes = {k: v.shape for k, v in Qwen3_5ForCausalLM(config).state_dict().items()}
    if preset.tie_word_embeddings:
        shapes.pop("lm_head.weight", None)
    directory.mkdir(parents=True)
    writer = ShardedSafetensorsWriter(directory, max_shard_bytes=2**30)
    g = torch.Generator().manual_seed(0)
    for name, shape in shapes.items():
        writer.add(name, (torch.randn(shape, generator=g) * 0.02).to(torch.bfloat16))
    writer.close()
    config.save_pretrained(directory)
    (directory / "tokenizer.json").write_text("{}")
    return sum(s.numel() for s in shapes.values())


def measure(cmd: list[str]) -> dict:
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    peak = 0
    root = psutil.Process(proc.pid)

    def sample():
        nonlocal peak
        while proc.poll() is None:
            try:
                procs = [root, *root.children(recursive=True)]
                peak = max(peak, sum(p.memory_info().rss for p in procs if p.is_running()))
            except psutil.Error:
                pass
            time.sleep(0.05)

    thread = threading.Thread(target=sample)
    thread.start()
    _, err = proc.communicate()
    thread.join()
    if proc.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{err[-2000:]}")
    return {"wall_s": round(time.perf_counter() - start, 1), "peak_rss_gb": round(peak / 2**30, 2)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--workdir", help="where to write the checkpoints (default: a temporary directory)")
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(args.workdir or tmp)
        params = write_synthetic_hf(work / "hf", args.layers)
        size_gb = sum(f.stat().st_size for f in (work / "hf").glob("*.safetensors")) / 2**30
        tool = [sys.executable, str(REPO / "tools" / "convert_checkpoint.py")]
        results = {
            "parameters": params, "hf_size_gb": round(size_gb, 2),
            "import": measure([*tool, "import", "--hf", str(work / "hf"), "--out", str(work / "mcore")]),
            "export": measure([*tool, "export", "--load", str(work / "mcore"), "--out", str(work / "back"),
                               "--max-shard-size-gb", "1"]),
        }
    print(f"synthetic Qwen3.5 checkpoint: {params / 1e9:.2f}B parameters, {size_gb:.2f} GiB bf16")
    for phase in ("import", "export"):
        r = results[phase]
        print(f"{phase:<7} wall {r['wall_s']:>6.1f} s   peak RSS {r['peak_rss_gb']:>5.2f} GiB")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
