"""``python tools/inspect_checkpoint.py DIR`` on each format it reads: the header, one row per tensor, the total."""

import json
import math
import re
import subprocess
import sys

from safetensors import safe_open

from tests.checkpoints import small_checkpoint
from tests.training.conftest import REPO

ROW = re.compile(r"(\S+)\s+(\[[\d, ]*\])\s+(\S+)\s*(\S*)")


def _inspect(*args):
    done = subprocess.run([sys.executable, "tools/inspect_checkpoint.py", *map(str, args)], cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    header_end = done.stdout.index("\n}\n") + 3
    return json.loads(done.stdout[:header_end]), done.stdout[header_end:].splitlines()


def test_hf_directory(tiny_hf_checkpoint):
    header, rows = _inspect(tiny_hf_checkpoint)
    with safe_open(str(tiny_hf_checkpoint / "model.safetensors"), framework="pt") as f:
        expected = {name: (f.get_slice(name).get_shape(), "float32") for name in f.keys()}
    assert header["format"] == "huggingface" and header["config"]["model_type"] == "qwen3_5_text"
    listed = {}
    for row in rows[:-1]:
        name, shape, dtype, shard = ROW.fullmatch(row).groups()
        assert shard == "model.safetensors", row
        listed[name] = (json.loads(shape), dtype)
    assert listed == expected
    assert rows[-1] == f"{len(expected)} tensors, {sum(math.prod(s) for s, _ in expected.values()):,} elements"


def test_dist_checkpoint_root(tmp_path):
    small_checkpoint(tmp_path, 7)
    header, rows = _inspect(tmp_path, "--all")
    assert header["format"] == "megatron torch_dist" and header["iteration"] == 7 and header["run_config"] is None
    assert ROW.fullmatch(rows[0]).groups() == ("w", "[1]", "float32", "") and rows[-1] == "1 tensors, 1 elements"


def test_docs_checkpoint_keys_show_the_tables_the_tool_prints():
    """Every ``<!-- key-table PRESET -->`` block of docs/checkpoint_keys.md is ``--key-table PRESET``'s output."""
    from megatron_mimesis.tools.inspect_checkpoint import key_table

    text = (REPO / "docs" / "checkpoint_keys.md").read_text()
    blocks = re.findall(r"<!-- key-table (\S+) -->\n## (.*?)\n<!-- end key-table -->", text, re.S)
    assert [preset for preset, _ in blocks] == ["qwen3-8b", "9b"]
    for preset, shown in blocks:
        assert shown == key_table(preset), f"docs/checkpoint_keys.md: the key table of {preset} is stale"
