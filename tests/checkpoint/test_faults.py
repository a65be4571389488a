"""The trainer's checkpoints under the faults of real runs: a finished job rerun (its final iteration saved
again), a shard truncated in the optimizer region, every checkpoint damaged, a crafted ``.metadata``; each met by
``--load``, ``tools/inspect_checkpoint.py`` and ``tools/convert_checkpoint.py export`` alike."""

import os
import pickle
import subprocess
import sys

import pytest
from torch.distributed.checkpoint import FileSystemReader

from megatron_mimesis.checkpoint.integrity import record_files, verify_files
from tests.training.conftest import REPO, common_args, read_metrics, run_trainer

pytestmark = pytest.mark.slow


class _CreatesFile:
    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return open, (self.path, "w")


def _losses(log_dir) -> dict[int, float]:
    return {r["iteration"]: r["loss"] for r in read_metrics(log_dir) if r.get("split") != "valid"}


def _tool(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=REPO, capture_output=True, text=True, timeout=300)


def _error_line(proc) -> str:
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and lines[-1].startswith("error: "), (proc.returncode, proc.stderr[-3000:])
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    return lines[-1]


def _truncate_in_optimizer_region(directory) -> tuple[str, int, int]:
    """Cut a shard inside the bytes of its last optimizer tensor, every model tensor left whole (an export reads
    only those); returns (file, new size, saved size)."""
    storage = FileSystemReader(str(directory)).read_metadata().storage_data
    by_file: dict[str, list] = {}
    for index, info in storage.items():
        by_file.setdefault(info.relative_path, []).append((info.offset, info.length, index.fqn))
    for name, items in sorted(by_file.items()):
        model_end = max((off + n for off, n, fqn in items if not fqn.startswith("optimizer.")), default=0)
        optimizer = [(off, n) for off, n, fqn in items if fqn.startswith("optimizer.") and off >= model_end]
        if optimizer:
            offset, length = max(optimizer)
            path = directory / name
            saved = path.stat().st_size
            with open(path, "r+b") as f:
                f.truncate(offset + length // 2)
            return name, offset + length // 2, saved
    raise AssertionError(f"{directory}: no shard with optimizer tensors after its model tensors")


def test_resave_damage_fallback_and_crafted_metadata_through_the_trainer_and_tools(tiny_dataset, tmp_path):
    ckpt = tmp_path / "ckpt"
    args = ["--train-iters", "3", "--save", str(ckpt), "--save-interval", "2"]
    run_trainer(1, *common_args(tiny_dataset, tmp_path / "first", *args))
    assert sorted(p.name for p in ckpt.iterdir()) == ["iter_0000002", "iter_0000003", "latest"]
    first = _losses(tmp_path / "first")

    # a finished job rerun (a requeue after the end): iteration 3 is resumed and saved again, in place
    run_trainer(1, *common_args(tiny_dataset, tmp_path / "rerun", *args, "--load", str(ckpt)))
    assert sorted(p.name for p in ckpt.iterdir()) == ["iter_0000002", "iter_0000003", "latest"]
    assert (ckpt / "latest").read_text().strip() == "3" and verify_files(ckpt / "iter_0000003") is None

    # a shard of the latest checkpoint cut in its optimizer state: the tools name it, --load falls back
    name, size, saved = _truncate_in_optimizer_region(ckpt / "iter_0000003")
    damage = f"{ckpt / 'iter_0000003' / name}: {size} bytes, {saved} were saved (truncated)"
    assert _error_line(_tool("tools/inspect_checkpoint.py", str(ckpt))) == f"error: {damage}"
    export = _tool("tools/convert_checkpoint.py", "export", "--load", str(ckpt), "--out", str(tmp_path / "hf"))
    assert _error_line(export) == f"error: {damage}" and not (tmp_path / "hf").exists()
    resumed = run_trainer(1, *common_args(tiny_dataset, tmp_path / "fallback", *args, "--load", str(ckpt)))
    warnings = [line for line in resumed.stderr.splitlines() if "newest complete checkpoint" in line]
    assert warnings == [f"warning: resuming from {ckpt / 'iter_0000002'}, the newest complete checkpoint; "
                        f"skipped: {damage}"], resumed.stderr[-3000:]
    assert _losses(tmp_path / "fallback") == {3: first[3]}  # step 3 again, exactly as the first time
    assert verify_files(ckpt / "iter_0000003") is None  # and saved whole over the damaged one
    assert sorted(p.name for p in ckpt.iterdir()) == ["iter_0000002", "iter_0000003", "latest"]

    # nothing complete left: refused in one line before any process group
    env = {**os.environ, "WORLD_SIZE": "1", "RANK": "0", "LOCAL_RANK": "0"}
    for iteration in (2, 3):
        with open(ckpt / f"iter_000000{iteration}" / ".metadata", "r+b") as f:
            f.truncate(100)
    train = [sys.executable, "-m", "megatron_mimesis.training.train", *common_args(tiny_dataset, tmp_path / "none",
                                                                                   *args, "--load", str(ckpt))]
    refused = subprocess.run(train, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    line = _error_line(refused)
    assert line.startswith(f"error: load: {ckpt}: no complete checkpoint (") and "iter_0000002/.metadata" in line

    # a crafted .metadata (its files.json rewritten to match): refused in one line, nothing executed
    marker = tmp_path / "pwned"
    (ckpt / "iter_0000003" / ".metadata").write_bytes(pickle.dumps(_CreatesFile(marker)))
    record_files(ckpt / "iter_0000003")
    refused = subprocess.run(train, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert _error_line(refused) == (f"error: load: {ckpt / 'iter_0000003' / '.metadata'}: refers to _io.open, "
                                    "which distributed checkpointing never writes; refusing to read it")
    assert not marker.exists()
