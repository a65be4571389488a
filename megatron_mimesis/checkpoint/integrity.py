"""What a dist checkpoint must prove before anything reads it: that it is data, and that it is whole.

*Data, not code.* torch distributed checkpointing stores ``.metadata`` as a pickle and the non-tensor objects of
the shards (RNG states, ...) as ``torch.save`` bytes, and reads them with ``pickle.load`` /
``torch.load(weights_only=False)``: a crafted checkpoint runs whatever it says on every reader. Checkpoints
move between people and clusters, so :func:`install_restricted_reader` replaces those two reads, once per
process, where every reader passes (torch's ``FileSystemReader``, which megatron-core's ``--load``, the tools
and the export all use): ``.metadata`` goes through an unpickler that admits only the classes distributed
checkpointing writes, and the shard objects through ``torch.load(weights_only=True)``, the loader megatron-core
itself uses for ``common.pt``.

*Whole.* Every checkpoint records the size of each of its files in ``files.json`` (and the sha256 of each file
small enough that hashing it costs nothing next to writing it: metadata, configs, tokenizer, the shards of small
models), written after every rank finished and before the directory is published, so it also marks a complete
checkpoint. A kill or a full disk truncates; :func:`verify_files` names the first file that does not match, in
one line, whatever region of the checkpoint (model or optimizer state) it holds. A checkpoint listed in ``files.json``
says so in its own ``run_config.json`` (``LISTED``), so one whose ``files.json`` is lost later is damaged, and only
a checkpoint without that record (written before ``files.json`` existed) is taken as complete on its ``.metadata``.
"""

import hashlib
import io
import json
import pickle
from pathlib import Path

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import StorageMeta

FILES = "files.json"
LISTED = "files_listed"  # run_config.json's record that the checkpoint's files are listed in files.json
RUN_CONFIG = "run_config.json"
HASHED_UP_TO = 64 * 2**20  # bytes; larger shards are checked by size (what truncation changes)
METADATA = ".metadata"

# Every global a torch_dist ``.metadata`` refers to (torch 2.14, megatron-core 0.19: the Metadata tree, its
# storage index, the save plans megatron caches in it, torch.Size, dtypes, layouts).
_DCP_CLASSES = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata", "MetadataIndex", "StorageMeta", "TensorProperties", "TensorStorageMetadata",
        "BytesStorageMetadata", "ChunkStorageMetadata", "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.planner": {"SavePlan", "WriteItem", "WriteItemType", "TensorWriteData"},
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},
    "collections": {"OrderedDict"},
    "pathlib": {"PosixPath", "PurePosixPath"},  # torch records the checkpoint_id it was saved under
}


class CheckpointError(RuntimeError):
    pass


class UnsafeCheckpointError(CheckpointError):
    """The checkpoint holds something other than data: refused, never skipped over."""


class _Refused(pickle.UnpicklingError):
    pass


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module, name):
        if name in _DCP_CLASSES.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise _Refused(f"refers to {module}.{name}, which distributed checkpointing never writes")


def load_metadata(stream, path) -> object:
    """The ``Metadata`` pickled in ``stream``, built from distributed checkpointing's own classes only."""
    try:
        return _MetadataUnpickler(stream).load()
    except _Refused as exc:
        raise UnsafeCheckpointError(f"{path}: {exc}; refusing to read it") from None
    except (pickle.UnpicklingError, EOFError, AttributeError, ValueError, TypeError, IndexError) as exc:
        raise CheckpointError(f"{path}: not a distributed-checkpoint metadata file "
                              f"({str(exc) or type(exc).__name__}: truncated or damaged)") from None


def _read_metadata(self, *args, **kwargs):
    # torch's FileSystemReader.read_metadata with the unpickler swapped; the rest is what torch does after it
    path = self._get_metadata_path(kwargs.get("rank"))
    with self.fs.create_stream(path, "rb") as stream:
        metadata = load_metadata(stream, path)
    if getattr(metadata, "storage_meta", None) is None:
        metadata.storage_meta = StorageMeta()
    metadata.storage_meta.load_id = self.load_id
    return metadata


_torch_load_bytes = DefaultLoadPlanner.load_bytes


def _load_bytes(self, read_item, value: io.BytesIO) -> None:
    try:
        obj = torch.load(value, weights_only=True)
    except pickle.UnpicklingError as exc:
        raise UnsafeCheckpointError(f"object {read_item.dest_index.fqn!r} of the checkpoint is not plain data "
                                    f"({str(exc).splitlines()[0]}); refusing to load it") from None
    # hand torch's own placement the already-safe object, re-serialised: no second copy of its logic here
    _torch_load_bytes(self, read_item, _as_stream(obj))


def _as_stream(obj) -> io.BytesIO:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    return buffer


def install_restricted_reader() -> None:
    """Route every distributed-checkpoint read of this process through the restricted loaders (idempotent)."""
    FileSystemReader.read_metadata = _read_metadata
    DefaultLoadPlanner.load_bytes = _load_bytes


def _listed(directory: Path) -> bool:
    try:
        return bool(json.loads((directory / RUN_CONFIG).read_text()).get(LISTED))
    except (OSError, ValueError, AttributeError):
        return False


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def record_files(directory: str | Path) -> None:
    """Write ``directory/files.json``: size (and sha256 where cheap) of every file the checkpoint holds; first mark
    its ``run_config.json`` (when it has one) as listed."""
    directory = Path(directory)
    run_config = directory / RUN_CONFIG
    if run_config.is_file():
        run_config.write_text(json.dumps({**json.loads(run_config.read_text()), LISTED: True}, indent=2,
                                         sort_keys=True))
    files = {}
    for path in sorted(p for p in directory.rglob("*") if p.is_file() and p.name != FILES):
        entry = {"size": path.stat().st_size}
        if entry["size"] <= HASHED_UP_TO:
            entry["sha256"] = _sha256(path)
        files[path.relative_to(directory).as_posix()] = entry
    (directory / FILES).write_text(json.dumps({"files": files}, indent=1, sort_keys=True))


def check_checkpoint(directory: str | Path) -> None:
    """Raise, in one line naming the file, unless ``directory`` is complete and its ``.metadata`` only data.

    Readers call this before handing the directory to torch / megatron-core, whose loaders would bury the reason
    in a per-rank traceback; the restricted reader installed below them stays the guarantee.
    """
    problem = verify_files(directory)
    if problem:
        raise CheckpointError(problem)
    path = Path(directory) / METADATA
    with path.open("rb") as stream:
        load_metadata(stream, path)


def verify_written(directory: str | Path) -> str | None:
    """Why the shards of the just-written ``directory`` do not hold what its ``.metadata`` says they do (one line),
    or None: every byte range the metadata points at lies inside its file. The check before a checkpoint is
    listed and published, independent of the writers' own reports."""
    directory = Path(directory)
    path = directory / METADATA
    if not path.is_file():
        return f"{path}: missing"
    with path.open("rb") as stream:
        metadata = load_metadata(stream, path)
    ends: dict[str, int] = {}
    for info in metadata.storage_data.values():
        ends[info.relative_path] = max(ends.get(info.relative_path, 0), info.offset + info.length)
    for name, end in sorted(ends.items()):
        shard = directory / name
        size = shard.stat().st_size if shard.is_file() else None
        if size is None or size < end:
            return f"{shard}: {'missing' if size is None else f'{size} bytes'}, the metadata needs {end}"
    return None


def verify_files(directory: str | Path) -> str | None:
    """Why ``directory`` is not a complete checkpoint (one line naming the file), or None when it is.

    A checkpoint written before ``files.json`` existed (its ``run_config.json`` does not record a listing) is complete
    when its ``.metadata`` is there.
    """
    directory = Path(directory)
    listing = directory / FILES
    if not listing.exists():
        if _listed(directory):
            return f"{listing}: missing, though {directory / RUN_CONFIG} records that the checkpoint was listed in it"
        return None if (directory / METADATA).exists() else f"{directory}: incomplete (no {FILES}, no {METADATA})"
    try:
        files = json.loads(listing.read_text())["files"]
    except (ValueError, KeyError, TypeError) as exc:
        return f"{listing}: unreadable ({exc})"
    for name, entry in files.items():
        path = directory / name
        if not path.is_file():
            return f"{path}: missing"
        size = path.stat().st_size
        if size != entry["size"]:
            return f"{path}: {size} bytes, {entry['size']} were saved ({'truncated' if size < entry['size'] else 'grown'})"
        if "sha256" in entry and _sha256(path) != entry["sha256"]:
            return f"{path}: content differs from what was saved (sha256 mismatch)"
    return None
