"""Evaluate user simulators against real humans on held-out conversations, side by side.

    python tools/eval_simulator.py --simulator NAME=SPEC [--simulator ...] --output DIR
        [--input a.jsonl ... --format messages|sharegpt|chitchat] [--valid-fraction F] [--max-conversations N]
        [--seq-length L] [--judge URL@MODEL [--taxonomy FILE]]
        [--outcomes FILE --agent SPEC --env toy|tau2 [--env-options JSON]] [--resume | --overwrite] ...

SPEC is ``hf:DIR``, ``ckpt:DIR`` (a dist checkpoint at any layout) or ``openai:URL@MODEL`` (with a tokenizer: our
simulator served, e.g. ``vllm serve`` of an export; without: a chat model playing the user from
``megatron_mimesis/eval/templates/play_the_user.txt``). Held-out conversations are read and rendered as
``python -m data_prep.midtrain`` reads and renders them (default: the embedded chit-chat corpus's valid split,
which the demo never trains on). Per simulator, with 95% bootstrap intervals over conversations: the likelihood
of the human turns (NLL/token, bits/byte), LLM-free behaviour statistics of its own turn at every human-turn
position against the human's, the four τ-USI dimensions (megatron_mimesis/eval/usi.py), and optionally a judge's
Turing distance and behaviour Dice (the MIMESIS paper's 13 behaviours by default), and the success-rate gap, the
per-task ECE, τ-USI's 5-bin difficulty ECE and τ-USI itself from one agent's episodes against it on tasks with
known real-user outcomes.

Writes table.md, table.csv, results.json, items.jsonl, lengths.png and metrics.png to DIR (and cache.jsonl,
which ``--resume`` continues from). Exit status 0 on success, 2 with a one-line reason on bad input.
"""

import argparse
import json
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

import openai
from transformers.utils import logging as hf_logging

from data_prep.records import DOUBLE_TEXTING, FORMATS
from data_prep.render import USER_SPEAKERS
from megatron_mimesis.checkpoint.model_card import record_evaluation
from megatron_mimesis.eval import report
from megatron_mimesis.eval.agents import (
    AGENT_KINDS,
    EpisodeSettings,
    EvalError,
    build_agent,
    parse_env_options,
    parse_spec,
    prepare_output,
)
from megatron_mimesis.eval.cache import CACHE, ResultCache
from megatron_mimesis.eval.calibration import OutcomeError, read_outcomes
from megatron_mimesis.eval.evaluation import (
    HUMAN,
    RowResult,
    add_judgements,
    add_likelihood,
    calibrate,
    calibrate_difficulty,
    human_observations,
    label_humans,
    metric_table,
    replies,
    simulator_observations,
)
from megatron_mimesis.eval.heldout import (
    HeldOutError,
    input_corpora,
    manifest_corpora,
    read_conversations,
    training_overlap,
)
from megatron_mimesis.eval.judge import DEFAULT_TAXONOMY, Judge, TaxonomyError, load_taxonomy
from megatron_mimesis.eval.simulators import Settings, SpecError, build, parse_specs
from megatron_mimesis.rl.envs import ENVS, build_suite

INTERNAL_FIELDS = ("unigrams", "bigrams", "usi", "human_usi")  # per-turn inputs of the metrics, not for items.jsonl
REPLY_BATCH = 16  # positions per request batch: the cache is written after each
INPUT_FORMATS = """\
input formats (--format; one record per line, docs/evaluating_simulators.md has the rules):
  messages (conversation logs: WildChat, LMSYS-Chat-1M; whole conversations):
    {"id": "c1", "messages": [
      {"role": "user", "content": "hey, is the pharmacy open sunday?"},
      {"role": "assistant", "content": "It is, 10 to 4."},
      {"role": "user", "content": "great thx"}]}
  sharegpt (dumps split into parts; not whole conversations unless --complete yes):
    {"id": "c2", "conversations": [
      {"from": "human", "value": "can you help me plan a trip"},
      {"from": "gpt", "value": "Sure! Where to?"},
      {"from": "human", "value": "lisbon, 3 days"}]}
  chitchat (chitchat-dataset's shape: one inner list per turn, one object per line the speaker sent):
    {"id": "c3", "messages": [
      [{"sender": "ann", "text": "hi!"}, {"sender": "ann", "text": "how was the trip"}],
      [{"sender": "bo", "text": "great, tiring"}],
      [{"sender": "ann", "text": "pics or it didnt happen"}]]}
The speaker that plays the user is --user-speaker; two messages in a row from one speaker follow --double-texting.
"""


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Every default in --help: appended where a flag has one; a flag without (None, off) says in its help what
    happens then."""

    def _get_help_string(self, action):
        text = action.help or ""
        unset = action.default is None or action.default is False or action.default in ([], argparse.SUPPRESS)
        if not unset and "%(default)" not in text:
            text += " (default: %(default)s)"
        return text


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=INPUT_FORMATS,
                                     formatter_class=HelpFormatter)
    parser.add_argument("--simulator", action="append", default=[], metavar="NAME=SPEC",
                        help="hf:DIR, ckpt:DIR or openai:URL@MODEL (repeatable)")
    parser.add_argument("--output", required=True, type=Path, metavar="DIR", help="where the results go")
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--resume", action="store_true", help="continue a killed run in --output from its cache")
    group.add_argument("--overwrite", action="store_true", help="write into a non-empty --output, from scratch")
    data = parser.add_argument_group("held-out conversations (as python -m data_prep.midtrain reads them)")
    data.add_argument("--input", dest="inputs", nargs="+", default=[], metavar="PATH",
                      help=".jsonl/.json lines, .parquet or a datasets name (default: the embedded chit-chat "
                           "corpus; with --manifest, that build's held-out split)")
    data.add_argument("--manifest", type=Path, metavar="FILE",
                      help="a data_prep build's manifest.json: without --input, score its held-out (valid) split, "
                           "read as it was built; with --input, count and warn about input conversations in its "
                           "training split")
    data.add_argument("--format", dest="record_format", choices=tuple(FORMATS), default="messages",
                      help="record layout of --input (examples below)")
    data.add_argument("--on-error", choices=("fail", "skip"),
                      help="a bad record (empty message, unknown role, bad JSON, ...): stop at the first, naming file "
                           "and line, or skip it and count it by reason in the results (default: fail for --input, "
                           "skip for the embedded corpus, the build's own for --manifest; as in data_prep)")
    data.add_argument("--double-texting", choices=DOUBLE_TEXTING, default="reject",
                      help="two messages in a row from one speaker: a bad record (non_alternating, see --on-error) "
                           "or merged into one turn, joined by a newline")
    for name in ("messages", "role", "content", "id"):
        data.add_argument(f"--{name}-field", help=f"record field holding the {name} (overrides --format)")
    data.add_argument("--complete", choices=("yes", "no"),
                      help="the records are whole conversations, so a human's last turn is where they left (the "
                           "ends statistic, the end marker's likelihood); default: the format's, as in data_prep")
    data.add_argument("--user-speaker", choices=USER_SPEAKERS,
                      help="who plays the user (default: both for the embedded corpus, role for --input)")
    data.add_argument("--split", default="train", help="split to read from a datasets input")
    data.add_argument("--valid-fraction", type=float, metavar="F",
                      help="keep only the conversations data_prep puts in its valid split at F (default for the "
                           "embedded corpus: data_prep's default; for --input: every conversation)")
    data.add_argument("--max-conversations", type=int, metavar="N",
                      help="read only the first N records of each corpus, before the train/valid split (as data_prep's "
                           "flag): the held-out conversations are the valid share of those N")
    data.add_argument("--seq-length", type=int, default=24576, help="likelihood windows, as the training rows")
    data.add_argument("--min-conversations", type=int, default=50, metavar="N",
                      help="warn (in the table and on stderr) when a row rests on fewer conversations")
    gen = parser.add_argument_group("sampling (the same for every simulator)")
    gen.add_argument("--max-new-tokens", type=int, default=128, help="per simulated turn")
    gen.add_argument("--temperature", type=float, default=1.0, help="sampling temperature")
    gen.add_argument("--thinking", action="store_true",
                     help="prompt with the thinking template (an SFT'd simulator); default off, as mid-trained")
    gen.add_argument("--tokenizer", metavar="DIR", help="tokenizer for every simulator (default: each one's own)")
    gen.add_argument("--no-likelihood", action="store_true", help="skip the teacher-forced likelihood")
    judge = parser.add_argument_group("judged metrics (optional)")
    judge.add_argument("--judge", metavar="URL@MODEL", help="an OpenAI-compatible chat endpoint and model")
    judge.add_argument("--taxonomy", type=Path, default=DEFAULT_TAXONOMY, help="behaviour labels (YAML)")
    judge.add_argument("--no-labels", action="store_true", help="only the Turing test, no behaviour labels")
    calib = parser.add_argument_group("task-difficulty calibration (optional)")
    calib.add_argument("--outcomes", type=Path, metavar="FILE", help='JSONL {"task_id", "success"} of real users')
    calib.add_argument("--agent", metavar="SPEC", help="the agent: hf:DIR or openai:URL@MODEL")
    calib.add_argument("--agent-tokenizer", metavar="DIR", help="tokenizer of an openai agent (default: its MODEL "
                                                                "when that is a directory)")
    calib.add_argument("--env", choices=[e for e in ENVS if e != "userrl"],
                       help="the environment the tasks come from (one whose user the runner plays: UserRL's gyms call "
                            "theirs themselves)")
    calib.add_argument("--env-options", default="{}", metavar="JSON", help="the env's options, as eval_agent's")
    calib.add_argument("--env-split", default="test", help="task split holding the outcome tasks")
    calib.add_argument("--success-reward", type=float, default=1.0,
                       help="episode reward that counts as success (1: tau2's task reward; 2 on the toy env)")
    calib.add_argument("--trials", type=int, default=1, help="episodes per task and simulator")
    calib.add_argument("--max-agent-turns", type=int, default=30, help="agent turns per episode")
    calib.add_argument("--agent-max-new-tokens", type=int, default=1024, help="per agent turn")
    parser.add_argument("--bootstrap", type=int, default=1000, metavar="N", help="bootstrap replicates (0: no CIs)")
    parser.add_argument("--concurrency", type=int, default=16, help="requests in flight per endpoint")
    parser.add_argument("--request-timeout", type=float, default=600, help="seconds per endpoint request")
    parser.add_argument("--seed", type=int, default=0, help="sampling, bootstrap and episode seed")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    return parser.parse_args(argv)


def endpoint(text: str, flag: str) -> tuple[str, str]:
    base_url, at, model = text.rpartition("@")
    if not at or not model or not base_url.startswith(("http://", "https://")):
        raise EvalError(f"{flag}: expected URL@MODEL with an http(s) URL, not {text!r}")
    return base_url, model


def check_reachable(base_url: str, flag: str, timeout: float) -> None:
    """A server that is down fails here, in one line, before any model is loaded."""
    try:
        openai.OpenAI(base_url=base_url, api_key="EMPTY", timeout=min(timeout, 10), max_retries=0).models.list()
    except openai.APIConnectionError:
        raise EvalError(f"{flag}: cannot connect to {base_url} (is the server up?)") from None
    except openai.OpenAIError:
        pass  # it answers; a server without /models is still usable


def validate(args):
    """Everything that can be wrong with the input, checked before any model is loaded."""
    if not args.simulator:
        raise EvalError("give at least one --simulator NAME=SPEC")
    for flag in ("max_new_tokens", "concurrency", "seq_length", "trials", "max_agent_turns"):
        if getattr(args, flag) < 1:
            raise EvalError(f"--{flag.replace('_', '-')} must be at least 1")
    if args.bootstrap < 0:
        raise EvalError("--bootstrap must be at least 0")
    if args.valid_fraction is not None and not 0.0 < args.valid_fraction < 1.0:
        raise EvalError(f"--valid-fraction must be in (0, 1), got {args.valid_fraction}")
    specs = parse_specs(args.simulator, args.tokenizer)
    for spec in specs:
        if spec.kind == "openai":
            check_reachable(spec.target, f"--simulator {spec.name}", args.request_timeout)
    judge = taxonomy = None
    if args.judge:
        judge = endpoint(args.judge, "--judge")
        taxonomy = None if args.no_labels else load_taxonomy(args.taxonomy)
    calibration = None
    if args.outcomes or args.agent or args.env:
        calibration = validate_calibration(args)
    held_out = read_held_out(args)
    if judge:
        check_reachable(judge[0], "--judge", args.request_timeout)
    prepare_output(args.output, args.resume, args.overwrite, CACHE)
    return specs, held_out, judge, taxonomy, calibration


READING_FLAGS = ("record_format", "messages_field", "role_field", "content_field", "id_field", "complete",
                 "user_speaker", "valid_fraction", "max_conversations", "double_texting")


def read_held_out(args):
    """The held-out conversations: --input read with the reading flags, or a --manifest's valid split read as it
    was built; with both, the input's overlap with the manifest's training split is counted."""
    manifest = manifest_corpora(args.manifest, args.on_error) if args.manifest else None
    if manifest and not args.inputs:
        parser_defaults = parse_args(["--output", "-"])
        given = [f"--{'format' if flag == 'record_format' else flag.replace('_', '-')}" for flag in READING_FLAGS
                 if getattr(args, flag) != getattr(parser_defaults, flag)]
        if given:
            raise EvalError(f"{', '.join(given)}: --manifest reads its corpora as they were built; these flags "
                            "apply to --input")
        return read_conversations(manifest)
    corpora = input_corpora(args.inputs, args.record_format, args.user_speaker, args.valid_fraction,
                            args.max_conversations, args.split, args.on_error, messages_field=args.messages_field,
                            role_field=args.role_field, content_field=args.content_field, id_field=args.id_field,
                            double_texting=args.double_texting,
                            complete=None if args.complete is None else args.complete == "yes")
    held_out = read_conversations(corpora)
    if manifest:
        held_out.training_overlap = training_overlap(held_out, manifest)
    return held_out


def validate_calibration(args):
    missing = [flag for flag, value in (("--outcomes", args.outcomes), ("--agent", args.agent), ("--env", args.env))
               if not value]
    if missing:
        raise EvalError(f"calibration needs --outcomes, --agent and --env; missing {', '.join(missing)}")
    real = read_outcomes(args.outcomes)
    agent = parse_spec(f"agent={args.agent}", "agent", AGENT_KINDS, args.env, args.agent_tokenizer)
    if agent.kind == "openai":
        check_reachable(agent.target, "--agent", args.request_timeout)
    options = parse_env_options(args.env_options)
    try:
        suite = build_suite(args.env, options)
        task_ids = set(suite.task_ids(args.env_split))
    except TypeError as err:
        raise EvalError(f"--env-options do not fit the {args.env} env: {err}") from None
    except (KeyError, ValueError) as err:
        raise EvalError(str(err.args[0] if err.args else err)) from None
    unknown = sorted(set(real) - task_ids)
    if unknown:
        raise EvalError(f"--outcomes {args.outcomes}: tasks not in split {args.env_split!r} of {suite.name}: "
                        f"{', '.join(unknown[:5])}")
    return real, agent, suite


def run(args, specs, held_out, judge_endpoint, taxonomy, calibration) -> str:
    progress = not args.no_progress
    settings = Settings(args.max_new_tokens, args.temperature, args.thinking, args.request_timeout,
                        args.concurrency, args.seed)
    positions = held_out.positions
    by_key = {p.key: p for p in positions}
    cache = ResultCache(args.output / CACHE)
    if progress and cache.reused:
        print(f"resuming: {cache.reused} cached results in {args.output / CACHE}", file=sys.stderr)
    judge = None
    if judge_endpoint:
        judge = Judge(*judge_endpoint, cache, taxonomy, args.seed, args.request_timeout, args.concurrency)
    human = RowResult(HUMAN, human_observations(positions))
    if judge and taxonomy:
        label_humans(human, judge, by_key, progress)
    rows, records = [human], []
    agent = episode_settings = None
    if calibration:
        real, agent_spec, suite = calibration
        agent = build_agent(agent_spec, args.seed, args.request_timeout, args.concurrency)
        episode_settings = EpisodeSettings(args.max_agent_turns, args.agent_max_new_tokens, 0.0, True, args.trials,
                                           args.seed)
        human.calibration = {"success_rate": sum(real.values()) / len(real), "gap": 0.0, "ece": None,
                             "ece_difficulty": None}
    with tempfile.TemporaryDirectory(prefix="eval-simulator-") as workdir:
        for spec in specs:
            simulator = build(spec, settings, Path(workdir))
            row = RowResult(spec.name)
            spec_key = {**asdict(spec), **asdict(settings)}
            answers = replies(simulator, spec_key, positions, cache, args.seed, REPLY_BATCH, progress)
            simulator_observations(row, positions, answers)
            if not args.no_likelihood:
                add_likelihood(row, simulator, held_out, args.seq_length)
            if judge:
                add_judgements(row, human, judge, by_key, progress)
            if calibration:
                records += calibrate(row, simulator, agent, suite, real, episode_settings,
                                     args.success_reward, progress)
            rows.append(row)
            del simulator
    if calibration:
        calibrate_difficulty(rows, real)
    cache.close()
    return write_outputs(args, specs, rows, held_out, taxonomy if judge else None, bool(judge), calibration, records)


def inputs_described(args) -> str:
    if args.manifest and not args.inputs:
        return f"the held-out split of `{args.manifest}`"
    return ", ".join(f"`{Path(i).name}`" for i in args.inputs) or "the embedded chit-chat corpus"


def write_outputs(args, specs, rows: list[RowResult], held_out, taxonomy, judged: bool, calibration,
                  records) -> str:
    table = metric_table(rows, taxonomy, judged, args.bootstrap, args.seed)
    counts = {row.name: {"conversations": len({o["unit"] for o in row.observations}),
                         "observations": len(row.observations), "likelihood_turns": len(row.likelihood),
                         "likelihood_tokens": sum(t["tokens"] for t in row.likelihood),
                         "generation_errors": dict(row.generation_errors), "judge_errors": dict(row.judge_errors),
                         "overlong_turns": row.overlong_turns, "likelihood_note": row.likelihood_note,
                         "unscored_tasks": (row.calibration or {}).get("unscored_tasks", 0),
                         "tasks": len(calibration[0]) if calibration else 0,
                         "difficulty_tasks": (row.calibration or {}).get("difficulty_tasks")} for row in rows}
    config = {key: (str(value) if isinstance(value, Path) else value) for key, value in vars(args).items()}
    results = {"config": config, "positions": len(held_out.positions), "renderings": len(held_out.renderings),
               "conversations": len(held_out.conversation_ids),
               "skipped_records": dict(held_out.skipped), "training_overlap": held_out.training_overlap,
               **table, "counts": counts,
               "calibration": {row.name: row.calibration for row in rows if row.calibration is not None}}
    report.write_json(args.output / "results.json", results)
    report.write_csv(args.output / "table.csv", table, bool(calibration))
    warnings = [w for w in (report.floor_warning(counts, args.min_conversations), overlap_warning(args, held_out))
                if w]
    for warning in warnings:
        print(warning, file=sys.stderr)
    markdown = report.markdown(table, counts, bool(calibration), dict(held_out.skipped), warnings)
    (args.output / "table.md").write_text(markdown)
    with open(args.output / "items.jsonl", "w") as items:
        for row in rows:
            nll = {o["key"]: o for o in row.likelihood}
            for o in row.observations:
                item = {"row": row.name, **{k: v for k, v in o.items() if k not in INTERNAL_FIELDS}}
                item.update({k: nll[o["key"]][k] for k in ("nll", "tokens", "bytes")} if o["key"] in nll else {})
                items.write(json.dumps(item, ensure_ascii=False) + "\n")
        for record in records:
            items.write(json.dumps({"row": record["user"], "episode": record}, ensure_ascii=False, default=str) + "\n")
    for spec in specs:  # an export of ours keeps its last evaluation in its model card
        if spec.kind == "hf":
            what = (f"`tools/eval_simulator.py`, {time.strftime('%Y-%m-%d')}: this export is the row `{spec.name}`; "
                    f"{results['conversations']} held-out conversations of {inputs_described(args)}.")
            record_evaluation(Path(spec.target), markdown, what)
    report.plot_lengths(args.output / "lengths.png", {row.name: row.observations for row in rows})
    report.plot_metrics(args.output / "metrics.png", table, bool(calibration))
    return markdown


def overlap_warning(args, held_out) -> str | None:
    if not held_out.training_overlap:
        return None
    return (f"warning: {held_out.training_overlap} of the {len(held_out.conversation_ids)} conversations scored are "
            f"in the training split of --manifest {args.manifest}: the simulator was trained on them")


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        inputs = validate(args)
    except (EvalError, SpecError, HeldOutError, TaxonomyError, OutcomeError, ImportError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.no_progress:
        hf_logging.disable_progress_bar()
    print(run(args, *inputs), end="")
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
