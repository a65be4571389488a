"""``python -m data_prep.rl_prompts``: a user's task and behaviour files -> the prompt records simulator RL reads
(``megatron_mimesis.rl.simulator.prompts``), one output file per task file.

Why a builder rather than hand-written records: a record's ``prompt`` is the simulator's system prompt, and the
reward its domain gets reads fields that must agree with it. A ``choice`` reference is the letter of an option the
prompt lists; the behaviour judge reads the behaviour the prompt asks the user to enact. Here one template writes
every prompt, each domain's reward follows from its tasks, and the output is read back by the trainer's own reader.

A task is one JSON object per line::

    {"id"?: str, "domain": str, "instructions": str, "opening"?: str,
     "answer"?: str | number | [str | number, ...], "options"?: [str, ...]}

``instructions`` say who the user is and what they are after, in the second person. ``opening`` is the assistant's
first message, when the conversation starts with one. A task with an ``answer`` is verifiable: the user's last
message is graded against it. Its domain's reward is ``choice`` when ``options`` are given (the answer is one of
them, or its letter), ``numeric`` for a number, else ``exact_match`` (a list: any of several answers). A task
without an answer is a behaviour task (reward ``behaviour``, the LLM judge): the user is given a behaviour to enact
from the behaviour file, one JSON object per line::

    {"name": str, "description": str}

The behaviour tasks are shuffled with ``--seed``; ``--neutral-fraction`` of them (the paper's third) get the neutral
behaviour, the rest the file's behaviours in turn, so each is enacted about as often. Without an ``id`` a task is
named by its content's hash, which stays the same when the file is reordered.

A bad task stops the build naming ``file:line`` and the field, or with ``--on-error skip`` is left out and counted by
reason; ``manifest.json`` (written last) holds the counts, each domain's reward and the ``domain_rewards`` map the
run config needs.
"""

import argparse
import json
import math
import os
import random
import sys
import time
from collections import Counter
from pathlib import Path

from data_prep.pipeline import PrepError, write_json
from data_prep.records import (
    EMPTY_CONTENT,
    MISSING_FIELD,
    WRONG_TYPE,
    RecordError,
    content_id,
    decode_json_line,
)
from data_prep.sources import open_source

TASK = "rl_prompts"
FORMAT_VERSION = 1
NEUTRAL_FRACTION = 1 / 3  # of the behaviour tasks, as in the paper's ABCD task
UNKNOWN_FIELD = "unknown_field"
BAD_ANSWER = "bad_answer"  # an option answer that is not one of the options, a non-finite number, an empty list
MIXED_DOMAIN = "mixed_domain"  # one domain, two kinds of answer: it could not have one reward
DUPLICATE_ID = "duplicate_id"
TASK_FIELDS = ("id", "domain", "instructions", "opening", "answer", "options")
LETTERS = "ABCDE"  # the letters the choice reward reads

USER = ("You are the user in a conversation with an AI assistant. Write only what this user says, one message at a "
        "time, in their own words; never answer as the assistant.\n\n{instructions}")
FINAL_ANSWER = "When you have what you came for, give your final answer on its own in your last message."
OPTIONS = "Your final answer is one of these; say its letter:\n{lines}"
BEHAVIOUR = ("Behave throughout as this user does ({name}): {description}\nShow it in what you say and when; never "
             "name or describe it.")
NEUTRAL = {"name": "neutral", "description": "an ordinary, cooperative user, with no behaviour beyond what the "
                                             "situation calls for"}


def _text(task: dict, field: str, location: str, required: bool = True) -> str | None:
    if field not in task:
        if required:
            raise RecordError(MISSING_FIELD, location, field, "missing")
        return None
    value = task[field]
    if not isinstance(value, str):
        raise RecordError(WRONG_TYPE, location, field, f"expected string, got {type(value).__name__}")
    if not value.strip():
        raise RecordError(EMPTY_CONTENT, location, field, "empty")
    return value.strip()


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _answer(task: dict, location: str) -> tuple[str, object, list[str] | None]:
    """``(reward, reference, options)`` of a verifiable task."""
    answer, options = task["answer"], task.get("options")
    if options is not None:
        if not isinstance(options, list) or not all(isinstance(o, str) and o.strip() for o in options):
            raise RecordError(WRONG_TYPE, location, "options", "expected a list of non-empty strings")
        if not 2 <= len(options) <= len(LETTERS):
            raise RecordError(BAD_ANSWER, location, "options", f"{len(options)} options; give 2 to {len(LETTERS)}")
        texts = [o.strip() for o in options]
        if isinstance(answer, str) and answer.strip() in texts:
            return "choice", LETTERS[texts.index(answer.strip())], texts
        if isinstance(answer, str) and answer.strip().upper() in LETTERS[: len(texts)]:
            return "choice", answer.strip().upper(), texts
        raise RecordError(BAD_ANSWER, location, "answer", f"{answer!r} is neither one of the options nor its letter")
    if _is_number(answer):
        if not math.isfinite(answer):
            raise RecordError(BAD_ANSWER, location, "answer", f"{answer} is not a finite number")
        return "numeric", answer, None
    if isinstance(answer, str):
        if not answer.strip():
            raise RecordError(EMPTY_CONTENT, location, "answer", "empty")
        return "exact_match", answer.strip(), None
    if isinstance(answer, list):
        if not answer or not all((isinstance(a, str) and a.strip()) or (_is_number(a) and math.isfinite(a))
                                 for a in answer):
            raise RecordError(BAD_ANSWER, location, "answer", "a list of answers must be non-empty strings or numbers")
        return "exact_match", [a.strip() if isinstance(a, str) else a for a in answer], None
    raise RecordError(WRONG_TYPE, location, "answer", f"expected string, number or list, got {type(answer).__name__}")


def to_task(record: object, location: str) -> dict:
    """A validated task: its record fields without ``prompt`` and ``behavior``, plus its domain's ``reward``."""
    if not isinstance(record, dict):
        raise RecordError(WRONG_TYPE, location, "<record>", f"expected an object, got {type(record).__name__}")
    unknown = sorted(set(record) - set(TASK_FIELDS))
    if unknown:
        raise RecordError(UNKNOWN_FIELD, location, unknown[0], f"not a task field (fields: {', '.join(TASK_FIELDS)})")
    task = {"id": _text(record, "id", location, required=False) or content_id(record),
            "domain": _text(record, "domain", location), "instructions": _text(record, "instructions", location),
            "opening": _text(record, "opening", location, required=False)}
    if "answer" in record:
        task["reward"], task["reference"], task["options"] = _answer(record, location)
    elif "options" in record:
        raise RecordError(MISSING_FIELD, location, "answer", "options without the answer among them")
    else:
        task["reward"] = "behaviour"
    return task


def prompt_record(task: dict, behaviour: dict | None) -> dict:
    """The record simulator RL reads: the task's instructions in the one simulator template."""
    parts = [USER.format(instructions=task["instructions"])]
    if task["reward"] != "behaviour":
        parts.append(FINAL_ANSWER)
    if task.get("options"):
        parts.append(OPTIONS.format(lines="\n".join(f"{LETTERS[i]}) {o}" for i, o in enumerate(task["options"]))))
    if behaviour is not None:
        parts.append(BEHAVIOUR.format(**behaviour))
    record = {"id": task["id"], "domain": task["domain"], "prompt": "\n\n".join(parts)}
    if task["opening"]:
        record["opening"] = task["opening"]
    if "reference" in task:
        record["reference"] = task["reference"]
    if behaviour is not None:
        record["behavior"] = behaviour
    return record


def read_behaviours(path: str) -> list[dict]:
    """The behaviour file, all or nothing: it is a short list a person wrote, so any fault stops the build."""
    behaviours, seen = [], {}
    for location, raw in open_source(path, "train").records():
        try:
            record = decode_json_line(raw, location)
            if not isinstance(record, dict) or set(record) != {"name", "description"}:
                raise RecordError(WRONG_TYPE, location, "<record>", 'expected {"name": str, "description": str}')
            behaviour = {key: _text(record, key, location) for key in ("name", "description")}
        except RecordError as err:
            raise PrepError(f"--behaviours: {err}") from None
        if behaviour["name"] in seen or behaviour["name"] == NEUTRAL["name"]:
            raise PrepError(f"--behaviours: {location}: name: {behaviour['name']!r} "
                            + (f"is also at {seen[behaviour['name']]}" if behaviour["name"] in seen else
                               "is the builder's own (--neutral-fraction gives it)"))
        seen[behaviour["name"]] = location
        behaviours.append(behaviour)
    if not behaviours:
        raise PrepError(f"--behaviours {path}: no behaviours")
    return behaviours


def assign_behaviours(count: int, behaviours: list[dict], neutral_fraction: float, seed: int) -> list[dict]:
    """The behaviour of each of ``count`` behaviour tasks, in their order: a seeded shuffle decides which tasks are
    neutral and the order the others take the behaviours in turn."""
    order = list(range(count))
    random.Random(f"{seed}/behaviours").shuffle(order)
    neutral = round(count * neutral_fraction)
    assigned = [NEUTRAL] * count
    for rank, index in enumerate(order[neutral:]):
        assigned[index] = behaviours[rank % len(behaviours)]
    return assigned


def build(inputs: list[str], output: str, behaviours: str | None = None,
          neutral_fraction: float = NEUTRAL_FRACTION, seed: int = 0, on_error: str = "fail") -> dict:
    """Build the records of ``inputs`` into ``output``; returns the manifest (``output/manifest.json``, written last:
    its presence means the build completed)."""
    from megatron_mimesis.rl.simulator.prompts import load_prompts

    if not inputs:
        raise PrepError("--input: at least one task file")
    if on_error not in ("fail", "skip"):
        raise PrepError(f"--on-error must be fail or skip, got {on_error!r}")
    if not 0.0 <= neutral_fraction <= 1.0:
        raise PrepError(f"--neutral-fraction must be in [0, 1], got {neutral_fraction}")
    started = time.perf_counter()
    listed = read_behaviours(behaviours) if behaviours else None
    out = Path(output)
    out.mkdir(parents=True, exist_ok=True)
    (out / "manifest.json").unlink(missing_ok=True)
    sources, files, seen, kinds = [open_source(spec, "train") for spec in inputs], {}, {}, {}
    if len({s.name for s in sources}) < len(sources):
        raise PrepError(f"--input: two task files would write the same {out}/<name>.jsonl: "
                        f"{[s.path for s in sources]}")
    for source in sources:
        tasks, counts = [], {"documents_in": 0, "skipped": Counter()}
        for location, raw in source.records():
            counts["documents_in"] += 1
            try:
                task = to_task(decode_json_line(raw, location) if isinstance(raw, bytes) else raw, location)
                if task["id"] in seen:
                    raise RecordError(DUPLICATE_ID, location, "id", f"{task['id']!r} is also at {seen[task['id']]}")
                first = kinds.setdefault(task["domain"], (task["reward"], location))
                if first[0] != task["reward"]:
                    raise RecordError(MIXED_DOMAIN, location, "domain", f"{task['domain']!r} would be scored by "
                                      f"{task['reward']} here and by {first[0]} at {first[1]}: one reward per domain")
            except RecordError as err:
                if on_error == "fail":
                    raise PrepError(f"{err} (--on-error skip leaves such tasks out and counts them)") from None
                counts["skipped"][err.reason] += 1
                continue
            seen[task["id"]] = location
            tasks.append(task)
        files[source.name] = (source, tasks, counts)
    behaviour_tasks = [task for _, tasks, _ in files.values() for task in tasks if task["reward"] == "behaviour"]
    if behaviour_tasks and listed is None:
        domains = sorted({task["domain"] for task in behaviour_tasks})
        raise PrepError(f"{len(behaviour_tasks)} tasks of domain(s) {domains} have no answer, so they are behaviour "
                        "tasks: give --behaviours (or an answer to each)")
    for task, behaviour in zip(behaviour_tasks, assign_behaviours(len(behaviour_tasks), listed or [],
                                                                  neutral_fraction, seed), strict=True):
        task["behaviour"] = behaviour
    manifest_files = {}
    for name, (source, tasks, counts) in files.items():
        path = out / f"{name}.jsonl"
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text("".join(json.dumps(prompt_record(task, task.get("behaviour"))) + "\n" for task in tasks))
        os.replace(tmp, path)
        manifest_files[name] = {
            "source": source.fingerprint(), "path": str(path.resolve()), "documents_in": counts["documents_in"],
            "records": len(tasks), "skipped": dict(counts["skipped"]),
            "domains": dict(sorted(Counter(task["domain"] for task in tasks).items())),
            "behaviours": dict(sorted(Counter(task["behaviour"]["name"] for task in tasks
                                              if "behaviour" in task).items()))}
        if not tasks:
            raise PrepError(f"{source.path}: no tasks from {counts['documents_in']:,} records (skipped: "
                            f"{dict(counts['skipped']) or 'none'})")
    load_prompts(entry["path"] for entry in manifest_files.values())  # as the trainer reads them
    written = {task["domain"] for _, tasks, _ in files.values() for task in tasks}
    manifest = {"format_version": FORMAT_VERSION, "task": TASK, "files": manifest_files,
                "domain_rewards": {domain: kinds[domain][0] for domain in sorted(written)},
                "behaviours": {"file": behaviours, "neutral_fraction": neutral_fraction, "seed": seed,
                               "listed": [b["name"] for b in listed or []]},
                "on_error": on_error, "elapsed_s": round(time.perf_counter() - started, 3)}
    write_json(out / "manifest.json", manifest)
    return manifest


def main(argv: list[str] | None = None) -> int:
    """The CLI (``python -m data_prep.rl_prompts``, or the ``mimesis-prep-rl-prompts`` console script)."""
    parser = argparse.ArgumentParser(prog="python -m data_prep.rl_prompts", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--input", dest="inputs", nargs="+", required=True, metavar="PATH",
                        help="task files (.jsonl), one output file each, named as the input")
    parser.add_argument("--output", required=True, help="output directory")
    parser.add_argument("--behaviours", metavar="PATH", help="behaviour file (.jsonl), for tasks without an answer")
    parser.add_argument("--neutral-fraction", type=float, default=NEUTRAL_FRACTION,
                        help="share of the behaviour tasks given the neutral behaviour")
    parser.add_argument("--seed", type=int, default=0, help="seed of the behaviours' assignment")
    parser.add_argument("--on-error", choices=("fail", "skip"), default="fail",
                        help="bad tasks: stop at the first, or leave them out and count them by reason")
    args = parser.parse_args(argv)
    try:
        manifest = build(args.inputs, args.output, args.behaviours, args.neutral_fraction, args.seed, args.on_error)
    except (PrepError, OSError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    for name, entry in manifest["files"].items():
        print(f"{name}: {entry['records']:,} of {entry['documents_in']:,} tasks -> {entry['path']}; domains "
              f"{entry['domains']}; behaviours {entry['behaviours'] or 'none'}; skipped {entry['skipped'] or 'none'}")
    print(f"for the run config: --prompts '{json.dumps([e['path'] for e in manifest['files'].values()])}' "
          f"--domain-rewards '{json.dumps(manifest['domain_rewards'])}'")
    return 0


if __name__ == "__main__":
    sys.exit(main())
