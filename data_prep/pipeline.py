"""The build: sources -> shards (in worker processes) -> packed megatron indexed datasets + mixture + manifest.

Output directory layout (``PrepConfig.output``):

* ``{corpus}/train`` and ``{corpus}/valid`` -- dataset prefixes (``.bin/.idx`` tokens, ``_loss_mask.bin/.idx``),
  read by ``megatron_mimesis.data.PackedConversationDataset``; ``{corpus}/manifest.json`` -- its counts.
* ``mixture.json`` -- ``{"train": [weight, prefix, ...], "valid": [...]}``, the format of Megatron-LM's
  ``--per-split-data-args-path`` (weights by train tokens unless given), read by
  ``megatron_mimesis.data.build_blended_datasets``.
* ``tokenizer/`` -- when trained here: a HF tokenizer directory (tokenizer.json + tokenizer_config.json).
* ``manifest.json`` -- written last; its presence means the build completed. It holds the cache key
  (``fingerprint``): a later build with the same inputs and options returns the existing output untouched.
* ``.work/`` -- finished shards of an interrupted build, reused when the build is restarted with the same
  fingerprint, deleted after success.
"""

import fcntl
import hashlib
import json
import os
import shutil
import time
import warnings
from collections import Counter, deque
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np

from data_prep.packing import pack
from data_prep.records import DOUBLE_TEXTING, FORMATS, RecordError, decode_json_line, to_conversation
from data_prep.render import END_MARKER, NOT_ENDED_REASONS, USER_SPEAKERS, end_turns
from data_prep.shards import SPLITS, ShardResult, ShardSettings, load_split, process_shard, worker_init
from data_prep.sources import Source, chitchat_source, open_source
from data_prep.synthetic import DESCRIPTION as SYNTHETIC_DESCRIPTION
from data_prep.synthetic import with_synthetic_thinking
from data_prep.tokenizer import ENDOFTEXT, load_encoder, tokenizer_sha256, train_bpe

FORMAT_VERSION = 3  # bump whenever the output changes for the same inputs and options
RECORDS_PER_SHARD = 512  # small enough to balance a few workers on the 7k-conversation demo corpus
SHARDS_PER_PACKING_GROUP = 256  # ~130k conversations packed together: good fill, bounded memory and open files
REPO_ROOT = Path(__file__).resolve().parent.parent
TASKS = ("midtrain", "sft")
DEFAULT_OUTPUT = {task: REPO_ROOT / ".cache" / "data" / f"chitchat-{task}" for task in TASKS}
SFT_DEMO_CONVERSATIONS = 128  # one sample per supervised turn: 128 chats already give ~5M tokens
DROP_REASONS = ("no_target_turn", "overlong_target_turns")
# renderings with a target: those whose last user turn carries the end marker, and the others by reason
END_TARGET_COUNTS = ("ended", *NOT_ENDED_REASONS)


class PrepError(RuntimeError):
    """A build that cannot proceed; the message is the one line the CLI prints."""


class SmallVocabWarning(UserWarning):
    """The tokenizer trained on the corpus has fewer tokens than ``--vocab-size`` asked for."""


@dataclass
class PrepConfig:
    """Options of one build; ``inputs`` empty means the embedded chit-chat corpus."""

    task: str = "midtrain"
    inputs: list[str] = field(default_factory=list)
    output: str | None = None
    tokenizer: str | None = None  # None: train a byte-level BPE of vocab_size on the corpus
    vocab_size: int = 4096
    seq_length: int = 24576
    workers: int = 1
    on_error: str | None = None
    user_speaker: str | None = None
    record_format: str = "messages"
    messages_field: str | None = None
    role_field: str | None = None
    content_field: str | None = None
    thinking_field: str | None = None
    id_field: str | None = None
    double_texting: str = "reject"
    split: str = "train"
    valid_fraction: float = 0.01
    weights: list[float] | None = None
    complete: list[bool] | None = None  # per input: its records are whole conversations (default: the format's)
    max_conversations: int | None = None
    progress: bool | None = None

    def __post_init__(self) -> None:
        if self.task not in TASKS:
            raise PrepError(f"task must be one of {TASKS}, got {self.task!r}")
        if self.on_error not in (None, "fail", "skip"):
            raise PrepError(f"--on-error must be fail or skip, got {self.on_error!r}")
        if self.double_texting not in DOUBLE_TEXTING:
            raise PrepError(f"--double-texting must be one of {DOUBLE_TEXTING}, got {self.double_texting!r}")
        if self.user_speaker is not None and self.user_speaker not in USER_SPEAKERS:
            raise PrepError(f"--user-speaker must be one of {USER_SPEAKERS}, got {self.user_speaker!r}")
        if self.record_format not in FORMATS:
            raise PrepError(f"--format must be one of {tuple(FORMATS)}, got {self.record_format!r}")
        if self.seq_length < 16:
            raise PrepError(f"--seq-length must be at least 16, got {self.seq_length}")
        if self.workers < 1:
            raise PrepError(f"--workers must be at least 1, got {self.workers}")
        if not 0.0 <= self.valid_fraction < 1.0:
            raise PrepError(f"--valid-fraction must be in [0, 1), got {self.valid_fraction}")
        if self.weights is not None and len(self.weights) != max(1, len(self.inputs)):
            raise PrepError(f"--weights needs one weight per input, got {len(self.weights)}")
        if self.complete is not None and len(self.complete) != max(1, len(self.inputs)):
            raise PrepError(f"--complete needs one yes/no per input, got {len(self.complete)}")
        if self.tokenizer is None and self.vocab_size < 512:
            raise PrepError(f"--vocab-size must be at least 512 to train a tokenizer, got {self.vocab_size}")

    @property
    def embedded(self) -> bool:
        return not self.inputs

    def resolved_output(self) -> Path:
        return Path(self.output) if self.output else DEFAULT_OUTPUT[self.task]

    def resolved_user_speaker(self) -> str:
        """Roles are kept as given unless asked; the embedded human-human corpus uses both speakers."""
        return self.user_speaker or ("both" if self.embedded else "role")

    def resolved_on_error(self) -> str:
        """Stop at the first bad record, except in the embedded corpus, whose 10 conversations with an empty
        turn are known and skipped (and counted)."""
        return self.on_error or ("skip" if self.embedded else "fail")

    def resolved_complete(self) -> list[bool]:
        """Per input, whether its records are whole conversations: as given, else the record format's default."""
        if self.complete is not None:
            return [bool(c) for c in self.complete]
        return [_record_format(self).complete] * max(1, len(self.inputs))

    def resolved_max_conversations(self) -> int | None:
        if self.max_conversations is None and self.embedded and self.task == "sft":
            return SFT_DEMO_CONVERSATIONS
        return self.max_conversations


@dataclass(frozen=True)
class BuildResult:
    output_dir: Path
    manifest: dict
    reused: bool


def build(config: PrepConfig) -> BuildResult:
    """Run (or reuse) a build and return its output directory and manifest.

    Builds into the same directory are serialised by a lock file, so a second caller waits and then reuses.
    With ``workers > 1`` the workers are spawned processes, so a calling script needs the usual
    ``if __name__ == "__main__":`` guard.
    """
    output = config.resolved_output()
    sources = [chitchat_source()] if config.embedded else [open_source(spec, config.split) for spec in config.inputs]
    names = [s.name for s in sources]
    if len(set(names)) != len(names):
        raise PrepError(f"two inputs map to the same corpus name: {names}")
    if config.tokenizer is not None and not Path(config.tokenizer).exists():
        raise PrepError(f"--tokenizer {config.tokenizer}: no such tokenizer directory or sentencepiece model")
    source_fingerprints = [s.fingerprint() for s in sources]
    fingerprint = _fingerprint(config, source_fingerprints)
    output.mkdir(parents=True, exist_ok=True)
    with open(output / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        manifest_path = output / "manifest.json"
        manifest = json.loads(manifest_path.read_text()) if manifest_path.is_file() else None
        reused = manifest is not None and manifest.get("fingerprint") == fingerprint
        if not reused:
            manifest_path.unlink(missing_ok=True)
            manifest = _build_unlocked(config, sources, source_fingerprints, fingerprint, output)
    vocab = manifest["tokenizer"]["vocab_size"]
    if config.tokenizer is None and vocab < config.vocab_size:
        warnings.warn(f"the tokenizer trained on the corpus has {vocab} tokens, fewer than the {config.vocab_size} "
                      f"of --vocab-size: the corpus has no more distinct merges to learn", SmallVocabWarning,
                      stacklevel=2)
    return BuildResult(output, manifest, reused=reused)


def _build_unlocked(
    config: PrepConfig, sources: list[Source], source_fingerprints: list[dict], fingerprint: str, output: Path
) -> dict:
    work = output / ".work"
    if not (work / "fingerprint").is_file() or (work / "fingerprint").read_text() != fingerprint:
        shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True, exist_ok=True)
    (work / "fingerprint").write_text(fingerprint)

    started = time.perf_counter()
    tokenizer_path = Path(config.tokenizer) if config.tokenizer else output / "tokenizer"
    if config.tokenizer is None and not (work / "tokenizer.done").is_file():
        train_bpe(_training_texts(config, sources), config.vocab_size, tokenizer_path)
        (work / "tokenizer.done").write_text(tokenizer_sha256(tokenizer_path))
    encoder = load_encoder(tokenizer_path)
    tokenizer_info = asdict(encoder.info(trained_here=config.tokenizer is None))
    pad_id = encoder.special[ENDOFTEXT]

    settings = ShardSettings(
        tokenizer=str(tokenizer_path),
        tokenizer_sha256=tokenizer_info["sha256"],
        record_format=_record_format(config),
        seq_length=config.seq_length,
        user_speaker=config.resolved_user_speaker(),
        with_thinking=config.task == "sft",
        synthetic_thinking=config.task == "sft" and config.embedded,
        valid_fraction=config.valid_fraction,
        skip_bad_records=config.resolved_on_error() == "skip",
        token_dtype="uint16" if encoder.vocab_size <= 65535 else "int32",
    )
    corpora = {}
    for index, source in enumerate(sources):
        complete = config.resolved_complete()[index]
        source_settings = replace(settings, record_format=replace(settings.record_format, complete=complete))
        counts = _run_shards(source, work / source.name, source_settings, config)
        corpus_manifest = _merge(counts, work / source.name, output / source.name, settings, pad_id)
        if corpus_manifest["samples_out"]["train"] == 0:
            raise PrepError(f"{source.name}: no training samples from {corpus_manifest['documents_in']:,} records "
                            f"(skipped: {_counts(corpus_manifest['skipped'])}; dropped: "
                            f"{_counts(corpus_manifest['dropped'])})")
        corpus_manifest.update(
            corpus=source.name,
            task=config.task,
            source=source_fingerprints[index],
            tokenizer=tokenizer_info,
            seq_length=config.seq_length,
            user_speaker=settings.user_speaker,
            complete=complete,
            end_marker=END_MARKER,
            valid_fraction=config.valid_fraction,
            # how the records were read, so a tool can read the same conversations (eval_simulator --manifest)
            record_format=asdict(source_settings.record_format),
            on_error=config.resolved_on_error(),
            split=source.split,
            max_conversations=config.resolved_max_conversations(),
            thinking=(SYNTHETIC_DESCRIPTION if settings.synthetic_thinking else "from input")
            if settings.with_thinking
            else "off",
            weight=config.weights[index] if config.weights else None,
        )
        write_json(output / source.name / "manifest.json", corpus_manifest)
        corpora[source.name] = corpus_manifest

    mixture = mixture_of(corpora)
    write_json(output / "mixture.json", mixture)
    elapsed = time.perf_counter() - started
    total_tokens = sum(c["tokens"][split] for c in corpora.values() for split in SPLITS)
    manifest = {
        "format_version": FORMAT_VERSION,
        "task": config.task,
        "fingerprint": fingerprint,
        "seq_length": config.seq_length,
        "tokenizer": tokenizer_info,
        "mixture": str((output / "mixture.json").resolve()),
        "corpora": corpora,
        "workers": config.workers,
        "elapsed_s": round(elapsed, 3),
        "tokens_per_s": round(total_tokens / elapsed) if elapsed > 0 else None,
    }
    write_json(output / "manifest.json", manifest)
    shutil.rmtree(work, ignore_errors=True)
    return manifest


def _record_format(config: PrepConfig):
    fmt = FORMATS["chitchat"] if config.embedded else FORMATS[config.record_format]
    return fmt.with_overrides(
        messages_field=config.messages_field,
        role_field=config.role_field,
        content_field=config.content_field,
        thinking_field=config.thinking_field,
        id_field=config.id_field,
        double_texting=config.double_texting,
    )


def _fingerprint(config: PrepConfig, source_fingerprints: list[dict]) -> str:
    """Cache key: everything that can change the output (not workers, progress or the output path)."""
    tokenizer = tokenizer_sha256(Path(config.tokenizer)) if config.tokenizer else f"train-bpe:{config.vocab_size}"
    key = {
        "format_version": FORMAT_VERSION,
        "task": config.task,
        "sources": source_fingerprints,
        "tokenizer": tokenizer,
        "record_format": asdict(_record_format(config)),
        "seq_length": config.seq_length,
        "user_speaker": config.resolved_user_speaker(),
        "on_error": config.resolved_on_error(),
        "valid_fraction": config.valid_fraction,
        "weights": config.weights,
        "complete": config.resolved_complete(),
        "max_conversations": config.resolved_max_conversations(),
        "sharding": [RECORDS_PER_SHARD, SHARDS_PER_PACKING_GROUP],
    }
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()


def _records(source: Source, config: PrepConfig):
    limit = config.resolved_max_conversations()
    for count, item in enumerate(source.records()):
        if limit is not None and count >= limit:
            return
        yield item


def _training_texts(config: PrepConfig, sources: list[Source]):
    """Texts for the offline BPE; bad records are left out here and reported by the build itself."""
    fmt = _record_format(config)
    for source, complete in zip(sources, config.resolved_complete(), strict=True):
        for location, raw in _records(source, config):
            try:
                record = decode_json_line(raw, location) if isinstance(raw, bytes) else raw
                conversation = to_conversation(record, location, fmt)
            except RecordError:
                continue
            if config.task == "sft" and config.embedded:
                conversation = with_synthetic_thinking(conversation)
            for turn in conversation.turns:
                yield turn.content
                if turn.thinking and config.task == "sft":
                    yield turn.thinking
            for end in end_turns(conversation.turns, config.resolved_user_speaker(), complete):
                if end is not None:
                    yield f" {END_MARKER}"


def _shards(source: Source, config: PrepConfig):
    batch = []
    for item in _records(source, config):
        batch.append(item)
        if len(batch) == RECORDS_PER_SHARD:
            yield batch
            batch = []
    if batch:
        yield batch


def _run_shards(source: Source, work: Path, settings: ShardSettings, config: PrepConfig) -> list[dict]:
    """Process all shards of one corpus, ``config.workers`` at a time, skipping those finished earlier."""
    from tqdm import tqdm

    work.mkdir(parents=True, exist_ok=True)
    counts: list[dict] = []
    bar = tqdm(
        desc=source.name, unit="tok", unit_scale=True, disable=None if config.progress is None else not config.progress
    )

    def collect(result: ShardResult) -> None:
        if result.error is not None:
            raise PrepError(result.error)
        counts.append(result.counts)
        bar.update(result.counts["train"]["tokens"] + result.counts["valid"]["tokens"])

    def finished(stem: str) -> ShardResult | None:
        path = Path(f"{stem}.json")
        return ShardResult(stem, json.loads(path.read_text())) if path.is_file() else None

    try:
        if config.workers == 1:
            for index, records in enumerate(_shards(source, config)):
                stem = str(work / f"shard-{index:06d}")
                collect(finished(stem) or process_shard(stem, records, settings))
            return counts
        import multiprocessing

        # spawn, not fork: workers import only data_prep (not torch / megatron), which starts them faster and
        # spares them copy-on-write faults on the parent's memory
        with multiprocessing.get_context("spawn").Pool(config.workers, worker_init) as pool:
            pending: deque = deque()
            for index, records in enumerate(_shards(source, config)):
                stem = str(work / f"shard-{index:06d}")
                done = finished(stem)
                if done is not None:
                    collect(done)
                    continue
                pending.append(pool.apply_async(process_shard, (stem, records, settings)))
                while len(pending) >= 2 * config.workers:
                    collect(pending.popleft().get())
            while pending:
                collect(pending.popleft().get())
        return counts
    finally:
        bar.close()


def _merge(counts: list[dict], work: Path, corpus_dir: Path, settings: ShardSettings, pad_id: int) -> dict:
    """Pack every split's samples across all shards of a corpus into rows; return the corpus's counts."""
    corpus_dir.mkdir(parents=True, exist_ok=True)
    stems = [str(work / f"shard-{i:06d}") for i in range(len(counts))]
    manifest: dict = {
        "documents_in": sum(c["documents_in"] for c in counts),
        "conversations": sum(c["conversations"] for c in counts),
        "content_tokens": sum(c["content_tokens"] for c in counts),
        "skipped": dict(sum((Counter(c["skipped"]) for c in counts), Counter())),
        "dropped": {reason: sum(c["dropped"][reason] for c in counts) for reason in DROP_REASONS},
        "end_targets": {reason: sum(c["end_targets"][reason] for c in counts) for reason in END_TARGET_COUNTS},
        "loss_tokens": {split: sum(c[split]["loss_tokens"] for c in counts) for split in SPLITS},
    }
    for split in SPLITS:
        prefix = corpus_dir / split
        for key, value in write_packed(stems, split, prefix, settings.seq_length, settings.token_dtype, pad_id).items():
            manifest.setdefault(key, {})[split] = value
        manifest.setdefault("prefixes", {})[split] = str(prefix.resolve())
    return manifest


def write_packed(stems: list[str], split: str, prefix: Path, seq_length: int, token_dtype: str, pad_id: int) -> dict:
    """Write one split as megatron indexed datasets (tokens + loss mask): one document per row, one sequence per
    sample plus a padding sequence. Files appear under their final names only when complete.

    Samples are packed within groups of ``SHARDS_PER_PACKING_GROUP`` shards, so that memory and open memory maps
    stay bounded however large the corpus; each group leaves at most a few partly filled rows.
    """
    from megatron_mimesis.compat import prepare_cpu_process

    prepare_cpu_process()  # torch's import-time log line about CUDA, on a CPU machine
    with warnings.catch_warnings():  # megatron.core's import warns about missing GPU-only packages
        warnings.simplefilter("ignore")
        from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

        from megatron_mimesis.data.packed import LOSS_MASK_SUFFIX  # the reader owns the on-disk format

    token_dtype = np.dtype(token_dtype)
    tmp = str(prefix.with_name(f".{split}.tmp"))
    tokens_out = IndexedDatasetBuilder(f"{tmp}.bin", dtype=token_dtype.type)
    masks_out = IndexedDatasetBuilder(f"{tmp}{LOSS_MASK_SUFFIX}.bin", dtype=np.uint8)
    counts = {"samples_out": 0, "tokens": 0, "rows": 0, "padding_tokens": 0}
    for first in range(0, len(stems), SHARDS_PER_PACKING_GROUP):
        parts = [load_split(stem, split) for stem in stems[first : first + SHARDS_PER_PACKING_GROUP]]
        lengths = np.concatenate([p[0] for p in parts])
        owner = np.repeat(np.arange(len(parts)), [len(p[0]) for p in parts])
        starts = np.concatenate([np.cumsum(p[0]) - p[0] for p in parts])
        rows = pack(lengths.tolist(), seq_length)
        for row in rows:
            token_parts, mask_parts, segment_lengths = [], [], []
            for sample in row:
                _, tokens, mask = parts[owner[sample]]
                begin, length = int(starts[sample]), int(lengths[sample])
                token_parts.append(tokens[begin : begin + length])
                mask_parts.append(mask[begin : begin + length])
                segment_lengths.append(length)
            pad = seq_length - sum(segment_lengths)
            if pad:
                token_parts.append(np.full(pad, pad_id, dtype=token_dtype))
                mask_parts.append(np.zeros(pad, dtype=np.uint8))
                segment_lengths.append(pad)
                counts["padding_tokens"] += pad
            tokens_out.add_document(np.concatenate(token_parts), segment_lengths)
            masks_out.add_document(np.concatenate(mask_parts), segment_lengths)
        counts["samples_out"] += len(lengths)
        counts["tokens"] += int(lengths.sum())
        counts["rows"] += len(rows)
    tokens_out.finalize(f"{tmp}.idx")
    masks_out.finalize(f"{tmp}{LOSS_MASK_SUFFIX}.idx")
    for suffix in (".bin", ".idx", f"{LOSS_MASK_SUFFIX}.bin", f"{LOSS_MASK_SUFFIX}.idx"):
        os.replace(f"{tmp}{suffix}", f"{prefix}{suffix}")
    return counts


def _counts(reasons: dict[str, int]) -> str:
    return ", ".join(f"{n:,} {reason}" for reason, n in sorted(reasons.items()) if n) or "none"


def mixture_of(corpora: dict[str, dict]) -> dict:
    """Per-split blends in Megatron-LM's --per-split-data-args-path format; empty splits are left out."""
    mixture = {}
    for split in SPLITS:
        entries = []
        for corpus in corpora.values():
            if corpus["rows"][split] == 0:
                continue
            weight = corpus["weight"] if corpus["weight"] is not None else corpus["tokens"]["train"]
            entries += [str(weight), corpus["prefixes"][split]]
        if entries:
            mixture[split] = entries
    return mixture


def write_json(path: Path, payload: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(payload, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, path)
