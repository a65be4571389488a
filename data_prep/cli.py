"""Command line shared by ``python -m data_prep.midtrain`` and ``python -m data_prep.sft``.

Both take the same flags, build (or reuse) the datasets with ``data_prep.pipeline.build`` and print a one-screen
summary; any failure exits non-zero with a one-line reason. ``--config FILE.yaml`` supplies ``PrepConfig`` fields
(``seq_length: 2048``, ``inputs: [a.jsonl]``, ...); flags given on the command line override it.
"""

import argparse
import sys
import warnings

from data_prep.pipeline import (
    DEFAULT_OUTPUT,
    SFT_DEMO_CONVERSATIONS,
    BuildResult,
    PrepConfig,
    PrepError,
    build,
)
from data_prep.records import DOUBLE_TEXTING, FORMATS
from data_prep.render import END_MARKER, USER_SPEAKERS

DESCRIPTIONS = {
    "midtrain": "User-side mid-training data: loss on the user turns, thinking off.",
    "sft": "Thought-supervised SFT data: target = <think>thinking</think> + the user's utterance.",
}


def parse_args(task: str, argv: list[str] | None) -> PrepConfig:
    parser = argparse.ArgumentParser(prog=f"python -m data_prep.{task}", description=DESCRIPTIONS[task])
    parser.add_argument(
        "--input",
        dest="inputs",
        nargs="+",
        default=[],
        metavar="PATH",
        help="corpora: .jsonl/.json lines, .parquet, or a `datasets` name/directory; one corpus each. "
        "Default: the embedded chit-chat corpus (both speakers as the user"
        + (f", first {SFT_DEMO_CONVERSATIONS} conversations, synthetic thinking)" if task == "sft" else ")"),
    )
    parser.add_argument("--output", help=f"output directory (default {DEFAULT_OUTPUT[task]})")
    tokenizer = parser.add_mutually_exclusive_group()
    tokenizer.add_argument(
        "--tokenizer", metavar="DIR", help="Hugging Face tokenizer directory (tokenizer.json) or sentencepiece .model"
    )
    tokenizer.add_argument(
        "--train-tokenizer", action="store_true", help="train a byte-level BPE on the corpus (the default)"
    )
    parser.add_argument("--vocab-size", type=int, default=4096, help="vocab of the trained BPE, incl. specials")
    parser.add_argument("--seq-length", type=int, default=24576, help="sample and packed row length")
    parser.add_argument("--workers", type=int, default=1, help="tokenising processes")
    parser.add_argument(
        "--on-error",
        choices=("fail", "skip"),
        help="bad records: stop at the first (default for --input) or skip and count (default for the embedded corpus)",
    )
    parser.add_argument(
        "--user-speaker",
        choices=USER_SPEAKERS,
        help="who plays the user: role (as given; default for --input), first/second speaker, or both",
    )
    parser.add_argument("--format", dest="record_format", choices=tuple(FORMATS), default="messages")
    parser.add_argument(
        "--double-texting",
        choices=DOUBLE_TEXTING,
        default="reject",
        help="two messages in a row from one speaker: a bad record (non_alternating, see --on-error) or merged into "
        "one turn, joined by a newline (default: reject)",
    )
    for name in ("messages", "role", "content", "thinking", "id"):
        parser.add_argument(f"--{name}-field", help=f"record field holding the {name} (overrides --format)")
    parser.add_argument("--split", default="train", help="split to read from a `datasets` input")
    parser.add_argument("--valid-fraction", type=float, default=0.01, help="share of conversations for valid")
    parser.add_argument("--weights", type=float, nargs="+", help="mixture weight per input (default: by tokens)")
    parser.add_argument(
        "--complete",
        type=_yes_no,
        nargs="+",
        metavar="yes|no",
        help="per input: its records are whole conversations, so each one's last user turn is trained to end it "
        f"with {END_MARKER} (default: the format's; yes for messages and the embedded corpus, no for sharegpt, "
        "whose dumps split long conversations)",
    )
    parser.add_argument("--max-conversations", type=int, help="read only the first N records of each corpus")
    parser.add_argument("--config", metavar="FILE.yaml", help="PrepConfig fields; command-line flags override them")
    args = parser.parse_args(argv)
    if args.config:
        parser.set_defaults(**_yaml_options(args.config, parser))
        args = parser.parse_args(argv)
    options = vars(args)
    options.pop("train_tokenizer")
    options.pop("config")
    return PrepConfig(task=task, **options)


def _yes_no(text: str) -> bool:
    answers = {"yes": True, "true": True, "no": False, "false": False}
    if text.lower() not in answers:
        raise argparse.ArgumentTypeError(f"expected yes or no, got {text!r}")
    return answers[text.lower()]


def _yaml_options(path: str, parser: argparse.ArgumentParser) -> dict:
    import yaml

    with open(path) as handle:
        options = yaml.safe_load(handle) or {}
    known = {action.dest for action in parser._actions} - {"help", "config", "train_tokenizer"}
    unknown = sorted(set(options) - known)
    if unknown:
        raise PrepError(f"{path}: unknown options {unknown} (known: {sorted(known)})")
    return options


def print_summary(result: BuildResult) -> None:
    from rich.console import Console
    from rich.table import Table

    manifest = result.manifest
    table = Table(
        title=f"{manifest['task']} -> {result.output_dir}" + (" (up to date, reused)" if result.reused else "")
    )
    for column in ("corpus", "records", "samples", "tokens", "loss tokens", "rows", "padding", "ends", "skipped",
                   "dropped"):
        table.add_column(column, justify="left" if column in ("corpus", "skipped", "dropped") else "right")
    for name, corpus in manifest["corpora"].items():
        tokens = sum(corpus["tokens"].values())
        padding = sum(corpus["padding_tokens"].values())
        table.add_row(
            name,
            f"{corpus['documents_in']:,}",
            " / ".join(f"{corpus['samples_out'][s]:,}" for s in ("train", "valid")),
            " / ".join(f"{corpus['tokens'][s]:,}" for s in ("train", "valid")),
            f"{sum(corpus['loss_tokens'].values()):,}",
            " / ".join(f"{corpus['rows'][s]:,}" for s in ("train", "valid")),
            f"{padding / max(1, tokens + padding):.2%}",
            _ends(corpus),
            _reasons(corpus["skipped"]),
            _reasons(corpus["dropped"]),
        )
    console = Console(width=max(132, Console().width))
    console.print(table)
    tokenizer = manifest["tokenizer"]
    console.print(
        f"(train / valid)  seq_length {manifest['seq_length']}  tokenizer {tokenizer['path']} "
        f"(vocab {tokenizer['vocab_size']}, sha256 {tokenizer['sha256'][:12]})"
    )
    console.print(
        f"{manifest['elapsed_s']:.1f} s with {manifest['workers']} worker(s), {manifest['tokens_per_s']:,} tokens/s; "
        f"mixture {manifest['mixture']}"
    )


def _ends(corpus: dict) -> str:
    """Renderings whose last user turn ends the conversation with the marker, of those with a target."""
    counts = corpus["end_targets"]
    return f"{counts['ended']:,} / {sum(counts.values()):,}" + ("" if corpus["complete"] else " (cut)")


def _reasons(counts: dict[str, int]) -> str:
    return "\n".join(f"{reason} {n:,}" for reason, n in sorted(counts.items()) if n) or "-"


def main(task: str, argv: list[str] | None = None) -> int:
    try:
        with warnings.catch_warnings(record=True) as caught:  # shown as one line each, after the summary
            result = build(parse_args(task, argv))
    except (PrepError, OSError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    print_summary(result)
    for warning in caught:
        print(f"warning: {warning.message}", file=sys.stderr)
    return 0
