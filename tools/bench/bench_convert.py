"""Conversion benchmark: wall time and peak RSS of import (HF -> dist checkpoint) and export (-> HF) on synthetic
checkpoints of one preset's widths and vocabulary at two or more depths, and the round trip check.

    python tools/bench/bench_convert.py [--preset 4b] [--layers 4 12] [--dtype bf16] [--workdir DIR] [--output DIR]
    python tools/bench/bench_convert.py --preset 9b --layers 32 --workdir /scratch/bench   # the paper's model, ~50 GiB disk

Each phase runs as its own process (the CLI users run); peak RSS is sampled over that process and its children.
Per phase it prints the peak RSS per GiB of checkpoint and, across the depths, the slope (extra RSS per extra GiB
of checkpoint): near 0 when the phase streams, about 1 when it holds the model. The round trip compares every
exported tensor with the original, bit for bit. The weights are random (the DeltaNet output-norm gains near 1, as
trained ones are, where the mapping's ``w - 1`` is exact); their values do not matter for speed or memory.
Results go to ``--output``/bench_convert.json; the checkpoints of each depth are deleted before the next.
"""

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil
import torch

from data_prep.tokenizer import train_bpe
from megatron_mimesis.models.hf_io import LazyHFState, ShardedSafetensorsWriter, safetensors_files
from megatron_mimesis.models.presets import PRESETS, get_preset

DEFAULT_OUTPUT = Path("runs") / "bench-convert"
HF_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def write_synthetic_hf(directory: Path, preset_name: str, layers: int, dtype: str) -> int:
    preset = get_preset(preset_name).replace(num_layers=layers)
    family = preset.family
    config = family.hf_config(preset, architectures=[family.hf_architecture], dtype=str(HF_DTYPES[dtype]).split(".")[1])
    with torch.device("meta"):
        shapes = {k: v.shape for k, v in family.hf_model_class()(config).state_dict().items()}
    if preset.tie_word_embeddings:
        shapes.pop("lm_head.weight", None)
    directory.mkdir(parents=True)
    writer = ShardedSafetensorsWriter(directory, max_shard_bytes=2**30)
    g = torch.Generator().manual_seed(0)
    for name, shape in shapes.items():
        values = torch.randn(shape, generator=g) * 0.02
        if name.endswith("linear_attn.norm.weight"):
            values += 1.0
        writer.add(name, values.to(HF_DTYPES[dtype]))
        del values
    writer.close()
    config.save_pretrained(directory)
    # an export is a servable simulator, whose chat template and stop ids are made of the chat special tokens
    train_bpe(["a synthetic checkpoint with a real tokenizer"], 300, directory)
    return sum(s.numel() for s in shapes.values())


def measure(cmd: list[str]) -> dict:
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
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
    return {"wall_s": round(time.perf_counter() - start, 1), "peak_rss_gib": round(peak / 2**30, 2)}


def round_trip_mismatches(original: Path, back: Path) -> list[str]:
    """Names of the original's tensors that the export lacks or changed (one tensor in memory at a time)."""
    source, exported = LazyHFState(original), LazyHFState(back)
    return [name for name in source if name not in exported or not torch.equal(source[name], exported[name])]


def bench_depth(work: Path, preset: str, layers: int, dtype: str) -> dict:
    hf, mcore, back = work / "hf", work / "mcore", work / "back"
    params = write_synthetic_hf(hf, preset, layers, dtype)
    size_gib = sum(f.stat().st_size for f in safetensors_files(hf)) / 2**30
    tool = [sys.executable, "-m", "megatron_mimesis.tools.convert_checkpoint"]  # tools/convert_checkpoint.py
    result = {"layers": layers, "parameters": params, "checkpoint_gib": size_gib,
              "import": measure([*tool, "import", "--hf", str(hf), "--out", str(mcore), "--dtype", dtype]),
              "export": measure([*tool, "export", "--load", str(mcore), "--out", str(back), "--dtype", dtype,
                                 "--max-shard-size-gb", "1"])}
    mismatches = round_trip_mismatches(hf, back)
    result["round_trip_bit_exact"] = not mismatches
    result["round_trip_mismatches"] = mismatches[:5]
    for phase in ("import", "export"):
        result[phase]["rss_per_checkpoint_gib"] = round(result[phase]["peak_rss_gib"] / size_gib, 2)
    for path in (hf, mcore, back):
        shutil.rmtree(path, ignore_errors=True)
    return result


def slope(runs: list[dict], phase: str) -> float | None:
    """Extra peak RSS per extra GiB of checkpoint, from the smallest to the largest depth."""
    first, last = runs[0], runs[-1]
    grown = last["checkpoint_gib"] - first["checkpoint_gib"]
    return round((last[phase]["peak_rss_gib"] - first[phase]["peak_rss_gib"]) / grown, 3) if grown > 0 else None


def print_report(results: dict) -> None:
    print(f"{'layers':>6} {'params':>8} {'ckpt GiB':>9}  {'import s':>8} {'RSS GiB':>8} {'/ckpt':>6}  "
          f"{'export s':>8} {'RSS GiB':>8} {'/ckpt':>6}  round trip")
    for r in results["runs"]:
        i, e = r["import"], r["export"]
        print(f"{r["layers"]:>6} {r["parameters"] / 1e6:>7,.0f}M {r['checkpoint_gib']:>9.2f}  {i['wall_s']:>8.1f} "
              f"{i['peak_rss_gib']:>8.2f} {i['rss_per_checkpoint_gib']:>6.2f}  {e['wall_s']:>8.1f} "
              f"{e['peak_rss_gib']:>8.2f} {e['rss_per_checkpoint_gib']:>6.2f}  "
              f"{'bit-exact' if r['round_trip_bit_exact'] else 'DIFFERS: ' + ', '.join(r['round_trip_mismatches'])}")
    if len(results["runs"]) > 1:
        print(f"peak RSS per extra GiB of checkpoint: import {results['import_slope']}, "
              f"export {results['export_slope']} (0 = bounded, 1 = grows with the model)")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="4b", choices=sorted(PRESETS), help="widths and vocabulary to use")
    parser.add_argument("--layers", type=int, nargs="+", default=[4, 12], help="depths to measure, smallest first")
    parser.add_argument("--dtype", choices=sorted(HF_DTYPES), default="bf16")
    parser.add_argument("--workdir", type=Path, help="where the checkpoints go (default: a temporary directory)")
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT, help="directory for bench_convert.json")
    args = parser.parse_args(argv)
    layers = sorted(args.layers)
    if layers[0] < 1:
        parser.error(f"--layers: depths must be at least 1, got {layers[0]}")
    if args.workdir:
        args.workdir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=args.workdir) as tmp:
        runs = []
        for depth in layers:
            runs.append(bench_depth(Path(tmp) / f"layers-{depth}", args.preset, depth, args.dtype))
            print(f"  {depth} layers done ({runs[-1]['import']['wall_s'] + runs[-1]['export']['wall_s']:.0f} s)",
                  flush=True)
    results = {"preset": args.preset, "dtype": args.dtype, "runs": runs,
               "import_slope": slope(runs, "import"), "export_slope": slope(runs, "export")}
    print_report(results)
    args.output.mkdir(parents=True, exist_ok=True)
    (args.output / "bench_convert.json").write_text(json.dumps(results, indent=2))
    print(f"wrote {args.output / 'bench_convert.json'}")
    return 0 if all(r["round_trip_bit_exact"] for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
