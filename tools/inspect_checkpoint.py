"""List the tensors (name, shape, dtype), iteration and config of a checkpoint, either format; or a family's key
table.

    python tools/inspect_checkpoint.py DIR [--filter SUBSTRING] [--all]
    python tools/inspect_checkpoint.py --key-table PRESET

DIR is an HF directory (safetensors), a megatron save root (uses ``latest``) or one ``iter_N`` directory.
Only headers and metadata are read: inspecting a 9B checkpoint loads no weights. ``--all`` includes the
optimizer state of dist checkpoints. ``--key-table`` prints, as a markdown table, every parameter of the preset's
family (one layer of each kind, ``N`` its index): its megatron name, the key a dist checkpoint stores it under
(megatron-core's own, which Megatron-Bridge's checkpoints share), the HF tensors it is made of and how.
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


def key_rows(preset_name: str) -> tuple[str, list[tuple[str, str, list[str], str]]]:
    """The key table of a preset's family (see the module docstring): its title and, per parameter, (megatron name,
    dist checkpoint key, HF tensors, layout), ``N`` standing for the layer index."""
    from megatron_mimesis.checkpoint.reader import fused_part_names, stacked_key, stored_name
    from megatron_mimesis.models.mapping import GroupedQKV, PerRankConcat, Split, VocabSplit
    from megatron_mimesis.models.presets import get_preset

    preset = get_preset(preset_name)
    family = preset.family
    kinds = family.layer_kind_of(preset)
    first = {kinds.index(kind) for kind in family.layer_kinds if kind in kinds}
    stacked = len(first) == 1  # megatron stacks the layers of a homogeneous block under one key

    def layer_of(name: str) -> int | None:
        where = stacked_key(name)
        return None if where is None else where[1]

    def how(entry) -> str:
        if isinstance(entry, VocabSplit):
            return "vocabulary rows, zero-padded to the padded vocabulary, split on dim 0"
        if isinstance(entry, GroupedQKV):
            return (f"per query group [q heads{', gate heads' if entry.output_gate else ''}, k, v]; TP splits whole "
                    f"groups")
        if isinstance(entry, PerRankConcat):
            return "each part split on dim 0 by TP, a rank's parts concatenated"
        if isinstance(entry, Split):
            return f"split on dim {entry.dim}"
        sign = "-" if entry.offset < 0 else "+"
        return "replicated" + (f", w_megatron = w_hf {sign} {abs(entry.offset):g}" if entry.offset else "")

    def pattern(name: str, layer: int | None) -> str:
        return name if layer is None else name.replace(f".{layer}.", ".N.", 1)

    title = f"{family.title} (`{preset.name}`; dist checkpoint layers {'stacked' if stacked else 'one key each'})"
    rows, seen = [], set()
    for entry in family.mapping(preset, preset.vocab_size):
        layer = layer_of(entry.megatron)
        name = pattern(entry.megatron, layer)
        if (layer is not None and layer not in first) or name in seen:
            continue
        seen.add(name)
        key = stacked_key(entry.megatron)[0] if stacked and layer is not None else stored_name(name)
        parts = fused_part_names(key)
        key = f"{key}.{{{','.join(p.rsplit('.', 1)[1] for p in parts)}}}" if parts else key
        rows.append((name, key, [pattern(n, layer) for n in entry.hf_names()], how(entry)))
    return title, rows


def key_table(preset_name: str) -> str:
    """:func:`key_rows` as markdown."""
    title, rows = key_rows(preset_name)
    lines = [title, "", "| megatron parameter | dist checkpoint key | HF tensors | layout |", "| --- | --- | --- | --- |"]
    lines += [f"| `{name}` | `{key}` | {', '.join(f'`{n}`' for n in hf)} | {layout} |" for name, key, hf, layout in rows]
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("path", nargs="?")
    parser.add_argument("--filter", default="", help="show only tensors whose name contains this")
    parser.add_argument("--all", action="store_true", help="include optimizer state (dist checkpoints)")
    parser.add_argument("--key-table", metavar="PRESET", help="print the key table of a preset's family instead")
    args = parser.parse_args(argv)
    if args.key_table:
        print(key_table(args.key_table))
        return 0
    if args.path is None:
        parser.error("give a checkpoint directory, or --key-table PRESET")
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
