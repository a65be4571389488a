"""Evaluate agents against a panel of user models on held-out tasks: the paper's Table 2.

    python tools/eval_agent.py --env toy|tau2 [--env-options JSON] --agent NAME=SPEC [--agent ...]
        --user NAME=SPEC [--user ...] --output DIR [--split test] [--tasks N] [--trials K] [--resume | --overwrite] ...

SPEC is ``hf:PATH`` (an HF checkpoint sampled in this process), ``openai:BASE_URL@MODEL`` (a server: for an
agent a ``/v1/completions`` endpoint that takes token ids, e.g. ``vllm serve``; for a user a chat endpoint), or,
for a user on the toy env, ``scripted:toy``. An agent trained against one simulator can overfit to it, so every
agent plays the same tasks against every user model, and the table reports each user's score, the average over
users and the agent's mean rank across users (rank 1 = best for that user; ties share the average rank), which
is robust to one user model's scale dominating the average.

A pair's score is the mean episode reward (the sum of the agent turns' rewards; tau2's is its 0/1 task reward)
over the episodes that could be scored. An episode whose user model or agent request failed, or that the env
could not score, is left out and counted in the report: scoring it 0 would blame the agent for an outage.

With ``--env userrl`` (UserRL's gyms, ``--env-options '{"gyms": {"FunctionGym": {}, "TelepathyGym": {}}}'``) the
gyms call their user themselves, so each ``--user`` is the endpoint of a served user model (``openai:URL@MODEL``),
which every gym of the pair calls through a per-episode proxy; the pairs are scored as the MIMESIS paper scores the
gyms: an episode by the sum of its turns' rewards (TravelGym's by its best turn), a task by the best of its
``--trials``, a pair by the mean over its tasks (the task-weighted average over gyms), and each gym on its own.

A pair plays its tasks in chunks of ``--chunk-tasks`` (chunk k seeded with ``--seed`` + k), each chunk's scored
episodes appended to DIR/cache.jsonl as it ends: a killed evaluation continues with ``--resume`` from the chunks it
finished, and ends with the table an uninterrupted run gives (a chunk is keyed by everything that decides its
episodes, so a changed setting replays it).

Writes results.json, table.csv, table.md, scores.png, episodes.jsonl (every episode's public transcript and
rewards) and cache.jsonl (the chunks, for --resume) to DIR, and for a suite of several domains (gyms) domains.md and
domains.csv: one row per agent x user, one column per domain and their task-weighted average. Exit status 0 on
success, 2 with a one-line reason on bad input.
"""

import argparse
import csv
import json
import math
import sys
from dataclasses import asdict, is_dataclass, replace
from pathlib import Path

from tqdm import tqdm
from transformers.utils import logging as hf_logging

from megatron_mimesis.eval.agents import (
    AGENT_KINDS,
    USER_KINDS,
    EpisodeSettings,
    EvalError,
    Spec,
    build_agent,
    build_user,
    parse_env_options,
    parse_specs,
    play_pair,
    prepare_output,
    score_pair,
    tokenizer_dir,
)
from megatron_mimesis.eval.cache import CACHE, ResultCache, cache_key
from megatron_mimesis.rl.envs import ENVS, build_suite
from megatron_mimesis.rl.envs.base import owns_user


# --------------------------------------------------------------------------- the table
def average_ranks(scores: dict[str, float]) -> dict[str, float]:
    """Rank 1 = the highest score; tied scores share the mean of the ranks they span."""
    return {name: 1 + sum(v > s for v in scores.values()) + (sum(v == s for v in scores.values()) - 1) / 2
            for name, s in scores.items()}


def summarize(pairs: list[dict], agents: list[str], users: list[str]) -> list[dict]:
    """One row per agent. A user on which an agent has no score leaves it unranked there, and its average and
    mean rank undefined: they would not be comparable with the other agents'."""
    score = {(p["agent"], p["user"]): p["score"] for p in pairs}
    ranks = {}
    for user in users:
        scored = {a: score[a, user] for a in agents if score[a, user] is not None}
        ranks.update({(a, user): r for a, r in average_ranks(scored).items()})
    rows = []
    for agent in agents:
        scores = [score[agent, u] for u in users]
        row_ranks = [ranks.get((agent, u)) for u in users]
        complete = all(s is not None for s in scores)
        rows.append({"agent": agent, "scores": dict(zip(users, scores, strict=True)),
                     "ranks": dict(zip(users, row_ranks, strict=True)),
                     "average": sum(scores) / len(scores) if complete else None,
                     "mean_rank": sum(row_ranks) / len(row_ranks) if complete else None})
    return rows


def _cell(value: float | None, digits: int) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


def floor_warning(pairs: list[dict], floor: int) -> str | None:
    """The warning for a table with a score resting on fewer scored tasks than ``floor`` (--min-tasks)."""
    fewest = min((p["n_tasks_scored"] for p in pairs), default=0)
    if fewest >= floor:
        return None
    return (f"warning: a score rests on {fewest} tasks, fewer than --min-tasks {floor}: differences between agents may "
            f"be noise; evaluate more tasks (--tasks, the split)")


def table_markdown(rows: list[dict], users: list[str], pairs: list[dict], warning: str | None) -> str:
    header = ["Agent", *users, "Average", "Mean rank"]
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(["---"] + ["---:"] * (len(header) - 1)) + "|"]
    for row in rows:
        cells = [row["agent"], *(_cell(row["scores"][u], 3) for u in users), _cell(row["average"], 3),
                 _cell(row["mean_rank"], 2)]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "Measured on (tasks with a scored episode; episodes scored of played):",
              *(f"- {p['agent']} x {p['user']}: {p['n_tasks_scored']} tasks; {p['n_scored']} of {p['n_episodes']} "
                f"episodes" for p in pairs)]
    if warning:  # floor_warning's
        lines += ["", warning]
    notes = [f"- {p['agent']} x {p['user']}: {p['n_episodes'] - p['n_scored']} of {p['n_episodes']} episodes "
             f"unscored ({', '.join(f'{k}: {v}' for k, v in sorted(p['failures'].items()))})"
             for p in pairs if p["n_scored"] < p["n_episodes"]]
    return "\n".join(lines + (["", "Left out of the scores:", *notes] if notes else [])) + "\n"


def domains_markdown(pairs: list[dict]) -> str:
    """Agent x user rows, a column per domain (gym) and the pair's task-weighted average."""
    domains = sorted({d for p in pairs for d in p["domain_scores"]})
    header = ["Agent", "User", *domains, "Average"]
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(["---", "---"] + ["---:"] * (len(header) - 2)) + "|"]
    for p in pairs:
        cells = [p["agent"], p["user"], *(_cell(p["domain_scores"].get(d), 3) for d in domains), _cell(p["score"], 3)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def write_domains_csv(path: Path, pairs: list[dict]) -> None:
    domains = sorted({d for p in pairs for d in p["domain_scores"]})
    with path.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["agent", "user", *domains, "average"])
        for p in pairs:
            values = [*(p["domain_scores"].get(d) for d in domains), p["score"]]
            writer.writerow([p["agent"], p["user"], *("" if v is None else f"{v:.6g}" for v in values)])


def write_table_csv(path: Path, rows: list[dict], users: list[str]) -> None:
    with path.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["agent", *users, "average", "mean_rank"])
        for row in rows:
            values = [*(row["scores"][u] for u in users), row["average"], row["mean_rank"]]
            writer.writerow([row["agent"], *("" if v is None else f"{v:.6g}" for v in values)])


def plot_scores(path: Path, rows: list[dict], users: list[str]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = [*users, "Average"]
    width = 0.8 / len(rows)
    fig, ax = plt.subplots(figsize=(max(6.0, 2.0 + 0.6 * len(groups) * len(rows)), 4))
    for k, row in enumerate(rows):
        values = [row["scores"][u] for u in users] + [row["average"]]
        bars = ax.bar([g + (k - (len(rows) - 1) / 2) * width for g in range(len(groups))],
                      [math.nan if v is None else v for v in values], width, label=row["agent"])
        ax.bar_label(bars, labels=[_cell(v, 2) for v in values], fontsize=8)
    ax.set_xticks(range(len(groups)), groups)
    ax.set_ylabel("score (mean episode reward)")
    ax.set_title("agents x user models")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _json_default(value):
    return asdict(value) if is_dataclass(value) else str(value)


# --------------------------------------------------------------------------- CLI
USER_MAX_NEW_TOKENS, USER_TEMPERATURE = 1024, 1.0


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--agent", action="append", default=[], metavar="NAME=SPEC",
                        help="an agent: hf:PATH or openai:BASE_URL@MODEL (repeatable)")
    parser.add_argument("--user", action="append", default=[], metavar="NAME=SPEC",
                        help="a user model: hf:PATH, openai:BASE_URL@MODEL or scripted:toy (repeatable)")
    parser.add_argument("--env", required=True, choices=ENVS)
    parser.add_argument("--env-options", default="{}", metavar="JSON", help='suite options as JSON, e.g. \'{"domain": "retail"}\'')
    parser.add_argument("--split", default="test", help="task split (default: test, the held-out tasks)")
    parser.add_argument("--tasks", type=int, metavar="N",
                        help="evaluate the first N tasks of the split, of each domain (gym) where it has several "
                             "(default: all)")
    parser.add_argument("--trials", type=int, default=1, metavar="K",
                        help="episodes per task and pair; a task scores the mean of its trials on tau2 and toy, their "
                             "best on userrl (UserRL's best of K)")
    parser.add_argument("--max-agent-turns", type=int, default=30, help="agent generations per episode")
    parser.add_argument("--max-new-tokens", type=int, default=1024, help="per agent generation")
    parser.add_argument("--temperature", type=float, default=0.0, help="agent sampling temperature (0: greedy)")
    parser.add_argument("--agent-thinking", action=argparse.BooleanOptionalAction, default=True,
                        help="render agent prompts with thinking on, in the agent family's thinking template (as "
                             "agent RL trains)")
    parser.add_argument("--user-max-new-tokens", type=int, help=f"per user turn (default {USER_MAX_NEW_TOKENS}; not "
                        "for userrl, whose gyms sample their user themselves: request_fields in --env-options)")
    parser.add_argument("--user-temperature", type=float, help=f"user model sampling temperature (default "
                        f"{USER_TEMPERATURE}; not for userrl, likewise)")
    parser.add_argument("--tokenizer", metavar="DIR", help="tokenizer directory for every agent and hf user (default: the "
                                            "checkpoint's, or an openai agent's MODEL when it is a directory)")
    parser.add_argument("--concurrency", type=int, default=32, help="requests in flight per endpoint")
    parser.add_argument("--request-timeout", type=float, default=600, help="seconds per endpoint request")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--min-tasks", type=int, default=30, metavar="N",
                        help="warn (in the table and on stderr) when a score rests on fewer tasks (default 30)")
    parser.add_argument("--chunk-tasks", type=int, default=64, metavar="N",
                        help="tasks a pair plays at once (all their trials), each chunk kept as it ends (default 64)")
    parser.add_argument("--output", required=True, type=Path, metavar="DIR", help="directory for results, tables, plot, episodes")
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--resume", action="store_true", help="continue a killed run in --output from its cache")
    group.add_argument("--overwrite", action="store_true", help="write into a non-empty --output, from scratch")
    parser.add_argument("--no-progress", action="store_true")
    return parser.parse_args(argv)


def validate(args) -> tuple[list[Spec], list[Spec], object, list[str]]:
    """Everything that can be wrong with the input, checked before any model is loaded."""
    if not args.agent or not args.user:
        raise EvalError("give at least one --agent and one --user")
    for flag in ("trials", "max_agent_turns", "max_new_tokens", "user_max_new_tokens", "concurrency", "chunk_tasks"):
        if getattr(args, flag) is not None and getattr(args, flag) < 1:
            raise EvalError(f"--{flag.replace('_', '-')} must be at least 1")
    if args.tasks is not None and args.tasks < 1:
        raise EvalError("--tasks must be at least 1")
    if args.tokenizer is not None:
        tokenizer_dir("--tokenizer", args.tokenizer)
    agents = parse_specs(args.agent, "agent", AGENT_KINDS, args.env, args.tokenizer)
    users = parse_specs(args.user, "user", USER_KINDS, args.env, args.tokenizer)
    options = parse_env_options(args.env_options)
    if args.env == "userrl":  # the gyms' evaluation reward, as UserRL reports, unless the options name the training one
        options.setdefault("reward", "eval")
        args.env_options = json.dumps(options)  # what results.json records: the options the run used
    if args.env == "tau2" and "domain" not in options:
        raise EvalError('--env tau2 needs --env-options \'{"domain": ...}\'')
    try:
        suite = build_suite(args.env, options)
        task_ids = suite.task_ids(args.split)
    except TypeError as err:
        raise EvalError(f"--env-options do not fit the {args.env} env: {err}") from None
    except (KeyError, ValueError) as err:  # userrl's UserRLError is a ValueError
        raise EvalError(str(err.args[0] if err.args else err)) from None
    if not task_ids:
        raise EvalError(f"split {args.split!r} of {suite.name} has no tasks")
    if args.tasks is not None:
        by_domain = {d: ids for d, (ids, _) in suite.mixture(args.split).items()}
        short = {d: len(ids) for d, ids in by_domain.items() if len(ids) < args.tasks}
        if short:
            raise EvalError(f"--tasks {args.tasks}: split {args.split!r} of {suite.name} has "
                            f"{', '.join(f'{n} tasks in {d}' for d, n in short.items())}")
        task_ids = [t for ids in by_domain.values() for t in ids[:args.tasks]]
    if owns_user(suite):
        wrong = [u.name for u in users if u.kind != "openai"]
        if wrong:
            raise EvalError(f"--user {', '.join(wrong)}: {suite.name}'s envs call their user themselves, so a user is "
                            f"an endpoint (openai:BASE_URL@MODEL, e.g. vllm serve of the simulator)")
        given = [flag for flag in ("--user-max-new-tokens", "--user-temperature")
                 if getattr(args, flag[2:].replace("-", "_")) is not None]
        if given:
            raise EvalError(f"{', '.join(given)}: {suite.name}'s envs sample their user themselves; set a gym's "
                            f"request_fields in --env-options instead")
    else:
        args.user_max_new_tokens = args.user_max_new_tokens or USER_MAX_NEW_TOKENS
        args.user_temperature = USER_TEMPERATURE if args.user_temperature is None else args.user_temperature
    prepare_output(args.output, args.resume, args.overwrite, CACHE)
    return agents, users, suite, task_ids


def evaluate(args, agents: list[Spec], users: list[Spec], suite, task_ids: list[str]) -> list[dict]:
    """Every agent x user pair, chunk by chunk; a chunk found in the cache is not played again, and an agent whose
    chunks are all there is never loaded."""
    user_models = {spec.name: build_user(spec, args.user_max_new_tokens, args.user_temperature, args.request_timeout,
                                         args.concurrency, args.seed, suite) for spec in users}
    settings = EpisodeSettings(args.max_agent_turns, args.max_new_tokens, args.temperature, args.agent_thinking,
                               args.trials, args.seed)
    chunks = [task_ids[i:i + args.chunk_tasks] for i in range(0, len(task_ids), args.chunk_tasks)]
    played = {"env": args.env, "env_options": json.loads(args.env_options), "split": args.split,
              "settings": asdict(settings)}
    cache = ResultCache(args.output / CACHE)
    if cache.reused and not args.no_progress:
        print(f"resuming: {cache.reused} chunks of episodes in {args.output / CACHE}", file=sys.stderr)
    pairs = []
    with (open(args.output / "episodes.jsonl", "w") as log,
          tqdm(total=len(agents) * len(users) * len(task_ids) * args.trials, unit="episode", desc="eval",
               disable=args.no_progress, dynamic_ncols=True) as bar):
        for agent in agents:
            player = None
            for user in users:
                bar.set_postfix_str(f"{agent.name} x {user.name}")
                records = []
                for k, chunk in enumerate(chunks):
                    key = cache_key("eval_agent", asdict(agent), asdict(user), played, chunk, k)
                    if key not in cache:
                        player = player or build_agent(agent, args.seed, args.request_timeout, args.concurrency)
                        played_chunk = play_pair(player, user_models[user.name], suite, chunk,
                                                 replace(settings, seed=args.seed + k), (agent.name, user.name))
                        cache.put(key, json.loads(json.dumps(played_chunk, default=_json_default)))
                    chunk_records = cache.get(key)
                    records += chunk_records
                    bar.update(len(chunk_records))
                pair = score_pair(agent.name, user.name, records, task_ids, suite)
                pairs.append(pair)
                for record in records:
                    log.write(json.dumps(record, default=_json_default) + "\n")
                log.flush()
                tqdm.write(f"{agent.name} x {user.name}: score {_cell(pair['score'], 3)} "
                           f"({pair['n_scored']}/{pair['n_episodes']} episodes scored)", file=sys.stderr)
            del player  # free its model before the next agent's is loaded
    cache.close()
    return pairs


def write_outputs(args, agents: list[Spec], users: list[Spec], suite, task_ids: list[str], pairs: list[dict]) -> str:
    agent_names, user_names = [a.name for a in agents], [u.name for u in users]
    rows = summarize(pairs, agent_names, user_names)
    config = {"env": args.env, "suite": suite.name, "env_options": json.loads(args.env_options),
              "split": args.split, "task_ids": task_ids, "trials": args.trials,
              "max_agent_turns": args.max_agent_turns, "max_new_tokens": args.max_new_tokens,
              "temperature": args.temperature, "agent_thinking": args.agent_thinking,
              "user_max_new_tokens": args.user_max_new_tokens, "user_temperature": args.user_temperature,
              "seed": args.seed, "chunk_tasks": args.chunk_tasks, "agents": dict(text.split("=", 1) for text in args.agent),
              "users": dict(text.split("=", 1) for text in args.user)}
    results = {"config": config, "pairs": pairs, "table": rows}
    (args.output / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    write_table_csv(args.output / "table.csv", rows, user_names)
    warning = floor_warning(pairs, args.min_tasks)
    if warning:
        print(warning, file=sys.stderr)
    markdown = table_markdown(rows, user_names, pairs, warning)
    (args.output / "table.md").write_text(markdown)
    plot_scores(args.output / "scores.png", rows, user_names)
    if len({d for p in pairs for d in p["domain_scores"]}) > 1:
        domains = domains_markdown(pairs)
        (args.output / "domains.md").write_text(domains)
        write_domains_csv(args.output / "domains.csv", pairs)
        markdown += "\n" + domains
    return markdown


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        agents, users, suite, task_ids = validate(args)
    except (EvalError, ImportError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.no_progress:
        hf_logging.disable_progress_bar()
    pairs = evaluate(args, agents, users, suite, task_ids)
    print(write_outputs(args, agents, users, suite, task_ids, pairs), end="")
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
