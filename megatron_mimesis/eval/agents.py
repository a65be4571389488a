"""Agents playing episodes against user models: the episode machinery that both evaluations share.

``tools/eval_agent.py`` runs every agent against a panel of user models; ``tools/eval_simulator.py`` runs one
agent against each simulator to see whether a simulator makes tasks as hard as real users found them. Both parse
``NAME=SPEC`` players, build them and score pairs here, with the env suites of :mod:`megatron_mimesis.rl.envs`
and the episode runner of agent RL, so an agent is evaluated the way it is trained.

A pair's episode is scored when it ran to the end; an episode whose user model or agent request failed, or that
the env could not score, is left out and counted by reason: scoring it 0 would blame the agent for an outage.

An episode's score is the suite's (the sum of its turn rewards; a UserRL TravelGym episode its best turn's), and a
task's the mean of its trials' or, where the suite scores best of k (UserRL's gyms, as the MIMESIS paper does), their
maximum; a pair's score is the mean over its tasks, and per domain (each gym) over the domain's tasks. For a suite
whose envs own their user, the user model is the endpoint the envs call (``openai:`` users only).
"""

import json
from dataclasses import dataclass
from pathlib import Path

from transformers import AutoTokenizer

from megatron_mimesis.models.presets import FAMILIES, FIRST_FAMILY, preset_from_hf_dir
from megatron_mimesis.rl.agent.agent_chat import agent_chat
from megatron_mimesis.rl.agent.episodes import AgentEpisodeRunner, count_failures, score_episodes
from megatron_mimesis.rl.agent.user_models import EngineUserModel, OpenAIUserModel
from megatron_mimesis.rl.chat import ChatRenderer
from megatron_mimesis.rl.engines.hf import HFEngine
from megatron_mimesis.rl.engines.openai import OpenAICompletionsEngine
from megatron_mimesis.rl.envs.base import owns_user
from megatron_mimesis.rl.envs.toy import toy_user
from megatron_mimesis.rl.types import SamplingParams

AGENT_KINDS = ("hf", "openai")
USER_KINDS = ("hf", "openai", "scripted")


class EvalError(Exception):
    """Bad input; the message is the one line printed."""


@dataclass(frozen=True)
class Spec:
    name: str
    kind: str  # "hf" | "openai" | "scripted"
    target: str  # checkpoint path, base URL, or "toy"
    model: str = ""  # the served model's name (openai)
    tokenizer: str = ""  # tokenizer directory (hf, and openai agents)


def parse_spec(text: str, role: str, kinds: tuple[str, ...], env: str, tokenizer: str | None) -> Spec:
    name, eq, spec = text.partition("=")
    if not eq or not name or not spec:
        raise EvalError(f"--{role} {text!r}: expected NAME=SPEC")
    kind, colon, target = spec.partition(":")
    where = f"--{role} {name}"
    if not colon or kind not in kinds or not target:
        raise EvalError(f"{where}: SPEC must be one of {', '.join(k + ':...' for k in kinds)}, not {spec!r}")
    if kind == "scripted":
        if target != "toy" or env != "toy":
            raise EvalError(f"{where}: scripted:toy is the only scripted user, and only for --env toy")
        return Spec(name, kind, target)
    if kind == "hf":
        if not (Path(target) / "config.json").is_file():
            raise EvalError(f"{where}: {target} is not an HF checkpoint directory (no config.json)")
        return Spec(name, kind, target, tokenizer=tokenizer_dir(where, tokenizer or target))
    base_url, at, model = target.rpartition("@")
    if not at or not model or not base_url.startswith(("http://", "https://")):
        raise EvalError(f"{where}: expected openai:BASE_URL@MODEL with an http(s) URL, not {spec!r}")
    if role == "user":
        return Spec(name, kind, base_url, model)
    if tokenizer is None and not Path(model).is_dir():
        raise EvalError(f"{where}: an openai agent needs --tokenizer (the served model's tokenizer directory)")
    return Spec(name, kind, base_url, model, tokenizer_dir(where, tokenizer or model))


def parse_env_options(text: str) -> dict:
    """``--env-options``: the environment suite's options, a JSON object."""
    try:
        options = json.loads(text)
    except json.JSONDecodeError as err:
        raise EvalError(f"--env-options is not JSON: {err.msg}") from None
    if not isinstance(options, dict):
        raise EvalError("--env-options must be a JSON object")
    return options


def tokenizer_dir(where: str, path: str) -> str:
    if not (Path(path) / "tokenizer_config.json").is_file():
        raise EvalError(f"{where}: no tokenizer in {path} (pass --tokenizer DIR)")
    return path


def parse_specs(texts: list[str], role: str, kinds: tuple[str, ...], env: str, tokenizer: str | None) -> list[Spec]:
    specs = [parse_spec(t, role, kinds, env, tokenizer) for t in texts]
    names = [s.name for s in specs]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise EvalError(f"--{role} names must be unique; repeated: {', '.join(duplicates)}")
    return specs




# --------------------------------------------------------------------------- building the players
@dataclass(frozen=True)
class Agent:
    engine: object
    tokenizer: object
    chat_format: object  # its family's ChatFormat: how its contexts are written and its turns read


def agent_chat_format(spec: Spec):
    """The agent's family, read from the ``config.json`` of its checkpoint (hf), or of the served model's directory
    or its tokenizer's (openai); a tokenizer alone, with no config beside it, is the project's first family's."""
    where = [spec.target] if spec.kind == "hf" else [spec.model, spec.tokenizer]
    for directory in where:
        if directory and (Path(directory) / "config.json").is_file():
            try:
                return preset_from_hf_dir(directory).family.chat
            except ValueError as exc:
                raise EvalError(f"--agent {spec.name}: {exc}") from None
    return FAMILIES[FIRST_FAMILY].chat


def build_agent(spec: Spec, seed: int, request_timeout: float, concurrency: int) -> Agent:
    """The engine, tokenizer and chat format of an agent; an endpoint's failed requests come back as error
    generations, so that the episodes they hit are counted as failed rather than ending the evaluation."""
    tokenizer = AutoTokenizer.from_pretrained(spec.tokenizer)
    chat_format = agent_chat_format(spec)
    if spec.kind == "hf":
        return Agent(HFEngine.from_pretrained(spec.target, tokenizer=tokenizer, seed=seed), tokenizer, chat_format)
    return Agent(OpenAICompletionsEngine(spec.target, spec.model, tokenizer, timeout_s=request_timeout,
                                         concurrency=concurrency, seed=seed, errors="return"), tokenizer, chat_format)


def build_user(spec: Spec, max_new_tokens: int, temperature: float, request_timeout: float, concurrency: int,
               seed: int, suite=None):
    """The user model of a pair; for a suite whose envs own their user, its endpoint's spec (``run_pair`` connects the
    suite to it: the envs call it with their own prompts and sampling)."""
    if suite is not None and owns_user(suite):
        return spec
    if spec.kind == "scripted":
        return toy_user()
    if spec.kind == "openai":
        return OpenAIUserModel(spec.target, spec.model, max_tokens=max_new_tokens, temperature=temperature,
                               timeout_s=request_timeout, concurrency=concurrency)
    tokenizer = AutoTokenizer.from_pretrained(spec.tokenizer)
    engine = HFEngine.from_pretrained(spec.target, tokenizer=tokenizer, seed=seed)
    sampling = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature)
    return EngineUserModel(engine, ChatRenderer(tokenizer, thinking=True), sampling)


@dataclass(frozen=True)
class EpisodeSettings:
    """How the agent plays every episode; one value for all pairs so that scores compare."""

    max_agent_turns: int
    max_new_tokens: int
    temperature: float
    agent_thinking: bool
    trials: int
    seed: int


# --------------------------------------------------------------------------- one agent x user pair
def run_pair(agent: Agent, user_model, suite, task_ids: list[str], settings: EpisodeSettings):
    """``user_model``: a user model, or for a suite whose envs own their user the endpoint's ``Spec``."""
    sampling = SamplingParams(max_new_tokens=settings.max_new_tokens, temperature=settings.temperature)
    chat = agent_chat(agent.chat_format, agent.tokenizer, thinking=settings.agent_thinking)
    if owns_user(suite):
        suite.connect(user_model.target, user_model.model)
        user_model = None
    runner = AgentEpisodeRunner(agent.engine, chat, user_model, sampling, settings.max_agent_turns)
    return runner.run(suite, task_ids, rollouts_per_task=settings.trials, step_seed=settings.seed)


def play_pair(agent: Agent, user_model, suite, task_ids: list[str], settings: EpisodeSettings, names: tuple[str, str]):
    """The pair's episodes on ``task_ids``, scored, as ``episode_records`` (``names``: the agent's and the user's)."""
    episodes = run_pair(agent, user_model, suite, task_ids, settings)
    score_episodes(episodes)
    return episode_records(*names, episodes, suite)


def score_pair(agent: str, user: str, records: list[dict], task_ids: list[str], suite) -> dict:
    """Score the pair from its episode records: those that ran to the end; the rest are counted by reason and kept
    out of the scores. Records, not episodes, so that a resumed evaluation scores what an earlier process played."""
    rewards = {task_id: [] for task_id in task_ids}
    for record in records:  # an episode left out of scoring has reward None
        rewards[record["task_id"]].append(record["reward"])
    scored = [r for task in rewards.values() for r in task if r is not None]
    domains = {}
    for task_id in task_ids:
        domains.setdefault(suite.domain_of(task_id), []).append(task_id)
    return {"agent": agent, "user": user, "score": pair_score(rewards, task_ids, suite.trial_score),
            "domain_scores": {d: pair_score(rewards, ids, suite.trial_score) for d, ids in sorted(domains.items())},
            "n_episodes": len(records), "n_scored": len(scored),
            "n_tasks_scored": sum(any(r is not None for r in task) for task in rewards.values()),
            "failures": count_failures(r["failure"] for r in records), "task_rewards": rewards}


def pair_score(rewards: dict[str, list], task_ids: list[str], trial_score: str) -> float | None:
    """Over ``task_ids``: the mean of their scored episodes ("mean"), or of each task's best scored trial ("max")."""
    scored = [[r for r in rewards[t] if r is not None] for t in task_ids]
    if trial_score == "max":
        best = [max(task) for task in scored if task]
        return sum(best) / len(best) if best else None
    flat = [r for task in scored for r in task]
    return sum(flat) / len(flat) if flat else None


def episode_reward(episode, suite) -> float | None:
    if episode.turn_rewards is None:
        return None
    return float(suite.episode_score(suite.domain_of(episode.task.task_id), episode.turn_rewards))


def episode_records(agent: str, user: str, episodes: list, suite) -> list[dict]:
    trials: dict[str, int] = {}
    records = []
    for episode in episodes:
        task_id = episode.task.task_id
        trials[task_id] = trials.get(task_id, 0) + 1
        failed = episode.termination.startswith("error")
        status = (f"failed: {episode.termination}" if failed else "unscored" if episode.turn_rewards is None
                  else "scored")
        records.append({
            "agent": agent, "user": user, "task_id": task_id, "trial": trials[task_id] - 1, "status": status,
            "termination": episode.termination, "reward": episode_reward(episode, suite), "failure": episode.failure,
            "turn_rewards": episode.turn_rewards, "agent_finish_reasons": [t.finish_reason for t in episode.turns],
            "unparsed_tool_calls": episode.unparsed_tool_calls,
            "score_info": episode.score_info, "messages": episode.messages,
        })
    return records


def prepare_output(path: Path, resume: bool, overwrite: bool, cache: str) -> None:
    """An evaluation's output directory: empty, or continued from its ``cache`` file (``--resume``), or started over
    (``--overwrite``, the cache dropped)."""
    if path.exists() and not path.is_dir():
        raise EvalError(f"--output {path} exists and is not a directory")
    if path.is_dir() and any(path.iterdir()) and not (resume or overwrite):
        raise EvalError(f"--output {path} is not empty; pass --resume to continue it or --overwrite")
    if resume and not (path / cache).is_file():
        raise EvalError(f"--resume: {path / cache} does not exist (nothing to resume)")
    path.mkdir(parents=True, exist_ok=True)
    if overwrite:
        (path / cache).unlink(missing_ok=True)
