"""Checkpoints that are crafted, damaged or caught mid-publish, read by the tools and the resume logic.

No process group: the checkpoints are torch DCP directories written here (``no_dist``) or miniatures with the
files the readers look at; the trainer's own checkpoints are exercised in tests/training/test_checkpoint_faults.py.
"""

import io
import json
import os
import pickle
import shutil
import subprocess
import sys

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from megatron_mimesis.checkpoint.integrity import (
    CheckpointError,
    UnsafeCheckpointError,
    record_files,
    verify_files,
)
from megatron_mimesis.checkpoint.reader import iteration_dir, newest_complete, resolve_checkpoint_dir
from megatron_mimesis.models.presets import get_preset, preset_record
from tests.models.harness import REPO


class _CreatesFile:
    """Unpickling this runs ``open(path, "w")``: the file exists afterwards iff the pickle was executed."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return open, (self.path, "w")


def _hostile_checkpoint(tmp_path):
    """A save root whose ``iter_0000003/.metadata`` creates ``marker`` when unpickled; its files.json matches
    (whoever crafts a checkpoint writes that too)."""
    directory = tmp_path / "hostile" / "iter_0000003"
    directory.mkdir(parents=True)
    marker = tmp_path / "pwned"
    (directory / ".metadata").write_bytes(pickle.dumps(_CreatesFile(marker)))
    preset = get_preset("tiny")
    (directory / "run_config.json").write_text(json.dumps({"preset": preset_record(preset),
                                                           "padded_vocab_size": preset.vocab_size}))
    record_files(directory)
    (tmp_path / "hostile" / "latest").write_text("3\n")
    return tmp_path / "hostile", marker


def _cli(*args):
    return subprocess.run([sys.executable, *args], cwd=REPO, capture_output=True, text=True, timeout=300)


def _one_error_line(proc) -> str:
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and lines and lines[-1].startswith("error: "), (proc.returncode, proc.stderr[-3000:])
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    return lines[-1]


def test_plain_pickle_would_run_the_crafted_metadata(tmp_path):
    """The premise of the tests below: this .metadata does execute when read the way torch reads it."""
    root, marker = _hostile_checkpoint(tmp_path)
    with open(root / "iter_0000003" / ".metadata", "rb") as f:
        pickle.load(f)  # noqa: S301 - the point of the test
    assert marker.exists()


@pytest.mark.parametrize("tool", ["inspect", "export"])
def test_crafted_metadata_is_refused_by_the_tools_and_runs_nothing(tmp_path, tool):
    root, marker = _hostile_checkpoint(tmp_path)
    if tool == "inspect":
        proc = _cli("tools/inspect_checkpoint.py", str(root))
    else:
        proc = _cli("tools/convert_checkpoint.py", "export", "--load", str(root), "--out", str(tmp_path / "hf"))
    line = _one_error_line(proc)
    assert line.endswith(".metadata: refers to _io.open, which distributed checkpointing never writes; "
                         "refusing to read it"), line
    assert not marker.exists()
    assert not (tmp_path / "hf").exists()


def test_real_metadata_and_shard_objects_still_load(tmp_path):
    state = {"w": torch.arange(6.0).reshape(2, 3), "rng": io.BytesIO()}
    torch.save({"torch": torch.get_rng_state(), "step": 7, "betas": (0.9, 0.95), "none": None}, state["rng"])
    dcp.save(state, checkpoint_id=str(tmp_path / "ok"), no_dist=True)
    loaded = {"w": torch.zeros(2, 3), "rng": io.BytesIO()}
    dcp.load(loaded, checkpoint_id=str(tmp_path / "ok"), no_dist=True)
    assert torch.equal(loaded["w"], state["w"])
    loaded["rng"].seek(0)
    rng = torch.load(loaded["rng"], weights_only=True)
    assert rng["step"] == 7 and rng["betas"] == (0.9, 0.95) and torch.equal(rng["torch"], torch.get_rng_state())


def test_megatrons_reader_and_shard_objects_are_restricted_too(tmp_path):
    """Below the early check: megatron-core's metadata reader (the trainer's --load) and the objects stored in
    the shards (RNG states, ...) go through the restricted loaders."""
    from megatron.core.dist_checkpointing.strategies.cached_metadata_filesystem_reader import (
        CachedMetadataFileSystemReader,
    )

    root, marker = _hostile_checkpoint(tmp_path)
    with pytest.raises(UnsafeCheckpointError, match="refers to _io.open"):
        CachedMetadataFileSystemReader(root / "iter_0000003").read_metadata()
    with pytest.raises(UnsafeCheckpointError, match="refers to _io.open"):
        newest_complete(root)  # refused, not skipped over to an older checkpoint
    dcp.save({"obj": _CreatesFile(marker)}, checkpoint_id=str(tmp_path / "bad"), no_dist=True)
    assert not marker.exists()
    with pytest.raises(CheckpointException, match="'obj' of the checkpoint is not plain data"):
        dcp.load({"obj": io.BytesIO()}, checkpoint_id=str(tmp_path / "bad"), no_dist=True)
    assert not marker.exists()


def _mini(directory, label: str):
    """A complete checkpoint in miniature: a real DCP directory plus a label, listed in files.json."""
    dcp.save({"w": torch.arange(1000.0)}, checkpoint_id=str(directory), no_dist=True)
    (directory / "label").write_text(label)
    record_files(directory)
    return directory


def _truncate(path, size: int) -> int:
    saved = path.stat().st_size
    with open(path, "r+b") as f:
        f.truncate(size)
    return saved


def test_truncation_and_changed_content_are_named_in_one_line(tmp_path):
    ckpt = _mini(tmp_path / "iter_0000001", "one")
    assert verify_files(ckpt) is None
    shard = ckpt / "__0_0.distcp"
    saved = _truncate(shard, 100)
    assert verify_files(ckpt) == f"{shard}: 100 bytes, {saved} were saved (truncated)"
    with pytest.raises(CheckpointError, match="truncated"):
        resolve_checkpoint_dir(ckpt)
    (ckpt / "label").write_text("eno")
    _mini(tmp_path / "other", "x")
    shutil.copy(tmp_path / "other" / "__0_0.distcp", shard)
    assert verify_files(ckpt) == f"{ckpt / 'label'}: content differs from what was saved (sha256 mismatch)"
    (ckpt / "label").unlink()
    assert verify_files(ckpt) == f"{ckpt / 'label'}: missing"
    (ckpt / "files.json").unlink()  # a checkpoint from before files.json: its .metadata must still parse
    saved = _truncate(ckpt / ".metadata", 50)
    with pytest.raises(CheckpointError, match=r"\.metadata: not a distributed-checkpoint metadata file \(.*: "
                                              r"truncated or damaged\)$"):
        resolve_checkpoint_dir(ckpt)


def test_a_listed_checkpoint_that_lost_its_files_json_is_damaged_not_legacy(tmp_path):
    """Deleting files.json used to turn every check off (the checkpoint then read as one from before files.json): a
    shard truncated after that went unnoticed until torch's EOFError. Its run_config.json says it was listed."""
    (tmp_path / "iter_0000001").mkdir()
    (tmp_path / "iter_0000001" / "run_config.json").write_text(json.dumps({"preset": {}}))
    older = _mini(tmp_path / "iter_0000001", "one")
    assert json.loads((older / "run_config.json").read_text())["files_listed"] is True
    assert verify_files(older) is None
    (tmp_path / "iter_0000002").mkdir()
    (tmp_path / "iter_0000002" / "run_config.json").write_text(json.dumps({"preset": {}}))
    damaged = _mini(tmp_path / "iter_0000002", "two")
    (tmp_path / "latest").write_text("2\n")
    (damaged / "files.json").unlink()
    _truncate(damaged / "__0_0.distcp", 10)
    reason = (f"{damaged / 'files.json'}: missing, though {damaged / 'run_config.json'} records that the checkpoint "
              f"was listed in it")
    assert verify_files(damaged) == reason
    with pytest.raises(CheckpointError, match="missing, though"):
        resolve_checkpoint_dir(tmp_path)  # the tools name it instead of reading a truncated shard
    assert newest_complete(tmp_path) == (older, [reason])  # --load falls back
    (damaged / "run_config.json").unlink()  # no record of a listing: a checkpoint from before files.json
    assert verify_files(damaged) is None


def test_load_falls_back_to_the_newest_complete_checkpoint(tmp_path):
    _mini(tmp_path / "iter_0000002", "two")
    damaged = _mini(tmp_path / "iter_0000004", "four")
    _mini(tmp_path / "iter_0000003", "three")
    saved = _truncate(damaged / "__0_0.distcp", 10)
    (tmp_path / "latest").write_text("4\n")
    path, skipped = newest_complete(tmp_path)
    assert path == tmp_path / "iter_0000003"
    assert skipped == [f"{damaged / '__0_0.distcp'}: 10 bytes, {saved} were saved (truncated)"]
    (tmp_path / "latest").write_text("9\n")  # points at a directory that is not there
    path, skipped = newest_complete(tmp_path)
    assert path == tmp_path / "iter_0000003" and skipped[0] == f"{tmp_path / 'iter_0000009'}: missing"
    # the tools read what they are told to, and name the damage instead of falling back
    (tmp_path / "latest").write_text("4\n")
    with pytest.raises(CheckpointError, match="truncated"):
        resolve_checkpoint_dir(tmp_path)
    shutil.rmtree(tmp_path / "iter_0000003")
    (tmp_path / "iter_0000002" / "label").write_text("owt")
    with pytest.raises(CheckpointError) as exc:
        newest_complete(tmp_path)
    assert str(exc.value).startswith(f"{tmp_path}: no complete checkpoint (") and "sha256 mismatch" in str(exc.value)
    assert "\n" not in str(exc.value)


class _Killed(Exception):
    pass


def test_resave_of_an_iteration_leaves_it_readable_at_every_kill_point(tmp_path, monkeypatch):
    """Rerun of a finished job: iteration 5 is saved again over itself. Kill publish after each of its
    filesystem operations (a removal killed half-way); iteration 5 must stay readable, old or new, and the
    next save must complete cleanly."""
    from megatron_mimesis.checkpoint import writer

    real_replace, real_rmtree = os.replace, shutil.rmtree
    point = 0
    while True:
        root = tmp_path / f"run{point}"
        _mini(root / "iter_0000005", "old")
        (root / "latest").write_text("5\n")
        calls = []

        def replace(src, dst, _calls=calls, _at=point):
            _calls.append("replace")
            if len(_calls) > _at:
                raise _Killed
            real_replace(src, dst)

        def rmtree(path, ignore_errors=False, _calls=calls, _at=point):
            _calls.append("rmtree")
            if len(_calls) > _at and os.path.isdir(path):
                os.remove(next(p for p in sorted(os.scandir(path), key=lambda e: e.name) if p.is_file()).path)
                raise _Killed
            real_rmtree(path, ignore_errors=ignore_errors)

        monkeypatch.setattr(writer.os, "replace", replace)
        monkeypatch.setattr(writer.shutil, "rmtree", rmtree)
        try:
            writer.publish(_mini(root / "iter_0000005.tmp", "new"), root, 5)
            finished = True
        except _Killed:
            finished = False
        monkeypatch.undo()
        readable = iteration_dir(root, 5)
        assert (readable / "label").read_text() in ("old", "new"), (point, calls)
        assert newest_complete(root) == (readable, []), point
        shutil.rmtree(root / "iter_0000005.tmp", ignore_errors=True)  # the requeued job's save, as save_checkpoint
        writer.publish(_mini(root / "iter_0000005.tmp", "newer"), root, 5)
        assert (root / "iter_0000005" / "label").read_text() == "newer"
        assert sorted(p.name for p in root.iterdir()) == ["iter_0000005", "latest"], point
        if finished:
            break
        point += 1
    assert point == len(calls) == 5  # rmtree, replace(final->old), replace(tmp->final), replace(latest), rmtree
