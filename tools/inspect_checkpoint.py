"""List the tensors (name, shape, dtype), iteration and config of a checkpoint, either format.

    python tools/inspect_checkpoint.py DIR [--filter SUBSTRING] [--all]

DIR is an HF directory (safetensors), a megatron save root (uses ``latest``) or one ``iter_N`` directory.
Only headers and metadata are read: inspecting a 9B checkpoint loads no weights. ``--all`` includes the
optimizer state of dist checkpoints.
"""

import argparse
import json
import sys
from pathlib import Path

from safetensors import safe_open
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from megatron_mimesis.checkpoint.reader import (
    RUN_CONFIG,
    CheckpointError,
    checkpoint_iteration,
    resolve_checkpoint_dir,
)
from megatron_mimesis.models.hf_io import safetensors_files

SAFETENSORS_DTYPES = {"F64": "float64", "F32": "float32", "BF16": "bfloat16", "F16": "float16", "I64": "int64",
                      "I32": "int32", "U8": "uint8", "BOOL": "bool", "F8_E4M3": "float8_e4m3fn"}


def hf_rows(directory: Path):
    for path in safetensors_files(directory):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                sl = f.get_slice(name)
                yield name, tuple(sl.get_shape()), SAFETENSORS_DTYPES.get(sl.get_dtype(), sl.get_dtype()), path.name


def dist_rows(directory: Path, include_optimizer: bool):
    metadata = FileSystemReader(str(directory)).read_metadata()
    for name, meta in sorted(metadata.state_dict_metadata.items()):
        if isinstance(meta, TensorStorageMetadata) and (include_optimizer or not name.startswith("optimizer.")):
            yield name, tuple(meta.size), str(meta.properties.dtype).removeprefix("torch."), ""


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("path")
    parser.add_argument("--filter", default="", help="show only tensors whose name contains this")
    parser.add_argument("--all", action="store_true", help="include optimizer state (dist checkpoints)")
    args = parser.parse_args(argv)
    path = Path(args.path)
    try:
        if (path / "config.json").exists():
            rows = list(hf_rows(path))
            header = {"format": "huggingface", "config": json.loads((path / "config.json").read_text())}
        else:
            directory = resolve_checkpoint_dir(path)
            rows = list(dist_rows(directory, args.all))
            run_config = directory / RUN_CONFIG
            header = {"format": "megatron torch_dist", "directory": str(directory),
                      "iteration": checkpoint_iteration(directory),
                      "run_config": json.loads(run_config.read_text()) if run_config.exists() else None}
    except (CheckpointError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(header, indent=2, default=str))
    shown = [r for r in rows if args.filter in r[0]]
    width = max((len(r[0]) for r in shown), default=4)
    for name, shape, dtype, where in shown:
        print(f"{name:<{width}}  {str(list(shape)):<20} {dtype:<9} {where}")
    total = sum(_numel(shape) for _, shape, _, _ in shown)
    print(f"{len(shown)} tensors, {total:,} elements")
    return 0


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


if __name__ == "__main__":
    sys.exit(main())
