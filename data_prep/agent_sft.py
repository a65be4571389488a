"""``python -m data_prep.agent_sft``: agent trajectories (OpenAI's chat format, ``data_prep.trajectories``) -> packed
SFT data for an agent, with the loss on the agent's turns only.

The rows are what the agent meets in agent RL: its tokenizer's own chat template (a released checkpoint carries it)
renders the messages with their ``tools``, as ``rl/agent/agent_chat.TemplateAgentChat`` renders every context,
and the rendered text is encoded whole, as the engine's prompts are. For Qwen3 that is hermes ``<tool_call>`` JSON,
tool results as ``<tool_response>`` blocks in a user turn, and ``enable_thinking`` from ``--thinking``.

A template that shows the agent's reasoning only after the last user message (Qwen3's) decides the samples: a
trajectory gives one sample per *chain*, the assistant turns between one user message and the next. A chain's
sample is the template's rendering of the trajectory up to its last assistant turn; its targets are those assistant
turns, each from after ``<|im_start|>assistant\\n`` through its ``<|im_end|>``, thinking and tool calls included,
and everything else (system, tools, user turns, tool results, earlier chains) is context. With ``--thinking off``
reasoning is dropped and the empty think block the template writes for the newest turn is context too, as the
generation prompt writes it. A sample longer than ``--seq-length`` is dropped and counted (``overlong``); samples
are packed into rows of ``--seq-length`` as the other builders pack theirs, into the same output layout (a
``manifest.json``, ``mixture.json`` and each corpus's ``train`` / ``valid`` datasets), so ``stage: sft`` trains on
it unchanged.
"""

import argparse
import json
import re
import shutil
import sys
import time
from collections import Counter
from dataclasses import asdict
from pathlib import Path

import numpy as np

from data_prep.pipeline import PrepError, mixture_of, write_json, write_packed
from data_prep.records import RecordError, decode_json_line
from data_prep.shards import SPLITS, split_of, write_split
from data_prep.sources import open_source
from data_prep.tokenizer import END_THINK, ENDOFTEXT, IM_END, IM_START, THINK, load_encoder
from data_prep.trajectories import Trajectory, to_trajectory

TASK = "agent_sft"
FORMAT_VERSION = 1
RECORDS_PER_SHARD = 512
EMPTY_THINK = f"{THINK}\n\n{END_THINK}\n\n"  # what Qwen3's template writes for a turn without reasoning
ASSISTANT_TURN = re.compile(re.escape(f"{IM_START}assistant\n") + "(.*?" + re.escape(IM_END) + ")", re.DOTALL)
DROP_REASONS = ("no_assistant_turn", "overlong")


class AgentTemplate:
    """The agent tokenizer's own chat template, and the samples of one trajectory rendered with it."""

    def __init__(self, tokenizer_dir: str, thinking: bool):
        from transformers import AutoTokenizer

        _check_family(Path(tokenizer_dir) / "config.json")
        self.tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
        if not getattr(self.tokenizer, "chat_template", None):
            raise PrepError(f"--tokenizer {tokenizer_dir}: no chat template (a released agent checkpoint carries it "
                            f"in tokenizer_config.json or chat_template.jinja; agent SFT rows are rendered with it)")
        self.thinking = thinking

    def render(self, messages: list[dict], tools) -> str:
        return self.tokenizer.apply_chat_template(messages, tools=list(tools) if tools else None, tokenize=False,
                                                  enable_thinking=self.thinking)

    def samples(self, trajectory: Trajectory, seq_length: int, drops: Counter) -> list[tuple[list[int], list]]:
        """``(tokens, target spans)`` per chain; a chain whose sample does not fit is dropped and counted."""
        messages = [m if self.thinking else {k: v for k, v in m.items() if k != "reasoning_content"}
                    for m in trajectory.messages]
        chains = _chains(messages)
        if not chains:
            drops["no_assistant_turn"] += 1
        samples = []
        for context_end, end in chains:
            context = self.render(messages[:context_end], trajectory.tools) if context_end else ""
            text = self.render(messages[:end], trajectory.tools)
            if not text.startswith(context):
                raise PrepError(f"the chat template does not render trajectory {trajectory.id}'s first "
                                f"{context_end} messages as the start of its first {end}: its samples cannot be "
                                f"cut at user messages")
            encoded = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
            if len(encoded["input_ids"]) > seq_length:
                drops["overlong"] += 1
                continue
            spans = [_token_span(encoded["offset_mapping"], *span) for span in self._targets(text, len(context))]
            samples.append((encoded["input_ids"], [(start, stop, 0) for start, stop in spans]))
        return samples

    def _targets(self, text: str, chain_start: int):
        """Character spans of the chain's assistant turns: body through ``<|im_end|>``."""
        for match in ASSISTANT_TURN.finditer(text, chain_start):
            start = match.start(1)
            if not self.thinking and text.startswith(EMPTY_THINK, start):
                start += len(EMPTY_THINK)
            yield start, match.end(1)


def _check_family(config: Path) -> None:
    """An agent checkpoint's family must render its contexts with its tokenizer's own template, as these rows do."""
    if not config.is_file():
        return
    from megatron_mimesis.models.presets import FAMILIES, family_of_model_type

    family = family_of_model_type(json.loads(config.read_text()).get("model_type"), str(config))
    if not family.chat.own_template:
        own = ", ".join(f.title for f in FAMILIES.values() if f.chat.own_template)
        raise PrepError(f"{config}: a {family.title} agent's contexts are rendered piece by piece in agent RL "
                        f"(models/family.ChatFormat), not by its tokenizer's chat template; agent SFT data is built "
                        f"for families whose agents use their own template ({own})")


def _chains(messages: list[dict]) -> list[tuple[int, int]]:
    """``(context_end, end)`` per chain: its messages start after the user message ending at ``context_end`` (or at
    the start) and end after its last assistant turn."""
    chains, start, last_assistant = [], 0, None
    for index, message in enumerate([*messages, {"role": "user"}]):
        if message["role"] == "user":
            if last_assistant is not None:
                chains.append((start, last_assistant + 1))
            start, last_assistant = index + 1, None
        elif message["role"] == "assistant":
            last_assistant = index
    return chains


def _token_span(offsets, start: int, stop: int) -> tuple[int, int]:
    """The tokens that lie inside characters ``[start, stop)``."""
    inside = [i for i, (a, b) in enumerate(offsets) if a >= start and b <= stop and b > a]
    return inside[0], inside[-1] + 1


def build(inputs: list[str], output: str, tokenizer: str, seq_length: int = 32768, thinking: bool = True,
          valid_fraction: float = 0.01, on_error: str = "fail", max_conversations: int | None = None,
          split: str = "train", progress: bool | None = None) -> dict:
    """Build agent SFT data from ``inputs`` into ``output``; returns the manifest (also ``output/manifest.json``,
    written last: its presence means the build completed)."""
    from tqdm import tqdm

    if not inputs:
        raise PrepError("--input: at least one trajectory file")
    if on_error not in ("fail", "skip"):
        raise PrepError(f"--on-error must be fail or skip, got {on_error!r}")
    if not 0.0 <= valid_fraction < 1.0:
        raise PrepError(f"--valid-fraction must be in [0, 1), got {valid_fraction}")
    if not Path(tokenizer).is_dir():
        raise PrepError(f"--tokenizer {tokenizer}: no such tokenizer directory")
    started = time.perf_counter()
    template = AgentTemplate(tokenizer, thinking)
    encoder = load_encoder(tokenizer)
    tokenizer_info = asdict(encoder.info(trained_here=False))
    token_dtype = "uint16" if encoder.vocab_size <= 65535 else "int32"
    out = Path(output)
    out.mkdir(parents=True, exist_ok=True)
    (out / "manifest.json").unlink(missing_ok=True)
    corpora = {}
    for spec in inputs:
        source = open_source(spec, split)
        work = out / ".work" / source.name
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir(parents=True)
        counts = {"documents_in": 0, "trajectories": 0, "assistant_turns": 0, "skipped": Counter(),
                  "dropped": Counter({reason: 0 for reason in DROP_REASONS})}
        stems, pending = [], {s: [] for s in SPLITS}
        bar = tqdm(desc=source.name, unit="traj", disable=None if progress is None else not progress)
        for location, raw in source.records():
            if max_conversations is not None and counts["documents_in"] >= max_conversations:
                break
            counts["documents_in"] += 1
            bar.update()
            try:
                trajectory = to_trajectory(decode_json_line(raw, location) if isinstance(raw, bytes) else raw,
                                           location)
            except RecordError as err:
                if on_error == "fail":
                    raise PrepError(f"{err} (--on-error skip leaves such records out and counts them)") from None
                counts["skipped"][err.reason] += 1
                continue
            counts["trajectories"] += 1
            samples = template.samples(trajectory, seq_length, counts["dropped"])
            counts["assistant_turns"] += sum(len(spans) for _, spans in samples)
            pending[split_of(trajectory.id, valid_fraction)].extend(samples)
            if counts["trajectories"] % RECORDS_PER_SHARD == 0:
                stems.append(_write_shard(work, len(stems), pending, token_dtype))
        stems.append(_write_shard(work, len(stems), pending, token_dtype))
        bar.close()
        corpora[source.name] = _corpus_manifest(source, counts, stems, out, seq_length, token_dtype,
                                                encoder.special[ENDOFTEXT], tokenizer_info, thinking, valid_fraction,
                                                on_error, max_conversations)
        if corpora[source.name]["samples_out"]["train"] == 0:
            raise PrepError(f"{source.name}: no training samples from {counts['documents_in']:,} records (skipped: "
                            f"{dict(counts['skipped']) or 'none'}; dropped: {dict(counts['dropped'])})")
    write_json(out / "mixture.json", mixture_of(corpora))
    shutil.rmtree(out / ".work", ignore_errors=True)
    elapsed = time.perf_counter() - started
    manifest = {"format_version": FORMAT_VERSION, "task": TASK, "seq_length": seq_length, "tokenizer": tokenizer_info,
                "thinking": thinking, "mixture": str((out / "mixture.json").resolve()), "corpora": corpora,
                "elapsed_s": round(elapsed, 3)}
    write_json(out / "manifest.json", manifest)
    return manifest


def _write_shard(work: Path, index: int, pending: dict, token_dtype: str) -> str:
    stem = str(work / f"shard-{index:06d}")
    for split in SPLITS:
        write_split(stem, split, pending[split], np.dtype(token_dtype))
        pending[split] = []
    return stem


def _corpus_manifest(source, counts: dict, stems: list[str], out: Path, seq_length: int, token_dtype: str,
                     pad_id: int, tokenizer_info: dict, thinking: bool, valid_fraction: float, on_error: str,
                     max_conversations: int | None) -> dict:
    corpus = {"corpus": source.name, "task": TASK, "source": source.fingerprint(), "split": source.split,
              "documents_in": counts["documents_in"], "trajectories": counts["trajectories"],
              "assistant_turns": counts["assistant_turns"], "skipped": dict(counts["skipped"]),
              "dropped": dict(counts["dropped"]), "thinking": thinking, "tokenizer": tokenizer_info,
              "seq_length": seq_length, "valid_fraction": valid_fraction, "on_error": on_error,
              "max_conversations": max_conversations, "weight": None}
    directory = out / source.name
    directory.mkdir(parents=True, exist_ok=True)
    for split in SPLITS:
        prefix = directory / split
        for key, value in write_packed(stems, split, prefix, seq_length, token_dtype, pad_id).items():
            corpus.setdefault(key, {})[split] = value
        corpus.setdefault("prefixes", {})[split] = str(prefix.resolve())
        corpus.setdefault("loss_tokens", {})[split] = int(sum(
            np.load(f"{stem}.{split}.mask.npy", mmap_mode="r").sum(dtype=np.int64) for stem in stems))
    write_json(directory / "manifest.json", corpus)
    return corpus


def main(argv: list[str] | None = None) -> int:
    """The CLI (``python -m data_prep.agent_sft``, or the ``mimesis-prep-agent-sft`` console script)."""
    parser = argparse.ArgumentParser(prog="python -m data_prep.agent_sft", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--input", dest="inputs", nargs="+", required=True, metavar="PATH",
                        help="trajectory files (.jsonl, .parquet or a `datasets` directory), one corpus each")
    parser.add_argument("--output", required=True, help="output directory")
    parser.add_argument("--tokenizer", required=True, metavar="DIR",
                        help="the agent's tokenizer directory, with its chat template (its released checkpoint)")
    parser.add_argument("--seq-length", type=int, default=32768, help="sample and packed row length")
    parser.add_argument("--thinking", choices=("on", "off"), default="on",
                        help="keep the agent's reasoning as a target (enable_thinking) or drop it")
    parser.add_argument("--valid-fraction", type=float, default=0.01, help="share of trajectories for valid")
    parser.add_argument("--on-error", choices=("fail", "skip"), default="fail",
                        help="bad records: stop at the first, or leave them out and count them by reason")
    parser.add_argument("--max-conversations", type=int, help="read only the first N records of each input")
    parser.add_argument("--split", default="train", help="split to read from a `datasets` input")
    args = parser.parse_args(argv)
    try:
        manifest = build(args.inputs, args.output, args.tokenizer, args.seq_length, args.thinking == "on",
                         args.valid_fraction, args.on_error, args.max_conversations, args.split)
    except (PrepError, OSError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    for name, corpus in manifest["corpora"].items():
        print(f"{name}: {corpus['trajectories']:,} of {corpus['documents_in']:,} trajectories, "
              f"{corpus['assistant_turns']:,} agent turns as targets; samples train / valid "
              f"{corpus['samples_out']['train']:,} / {corpus['samples_out']['valid']:,}, rows "
              f"{corpus['rows']['train']:,} / {corpus['rows']['valid']:,}, loss tokens "
              f"{sum(corpus['loss_tokens'].values()):,}; skipped {corpus['skipped'] or 'none'}; dropped "
              f"{ {k: v for k, v in corpus['dropped'].items() if v} or 'none'}")
    print(f"{TASK} -> {args.output} in {manifest['elapsed_s']:.1f} s (seq_length {manifest['seq_length']}, thinking "
          f"{args.thinking}, tokenizer sha256 {manifest['tokenizer']['sha256'][:12]})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
