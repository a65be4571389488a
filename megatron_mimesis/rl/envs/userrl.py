"""UserRL's gyms (TravelGym, TauGym, TurtleGym, PersuadeGym, FunctionGym, IntentionGym, TelepathyGym, SearchGym) as
agent-RL environments that own their user, run by the gyms' own code.

The gyms are not on the package registries: each is installed from a clone of SalesforceAIResearch/UserRL
(``pip install -e UserRL/gyms/FunctionGym``; ``make venv`` installs them from ``../shared/third_party`` when that
folder is there). A gym is a Gymnasium env over text: ``reset()``, then ``step("[action] ...")`` with one of its
action prefixes, its observation's ``feedback`` the answer. As in UserRL, the agent acts on it through one tool,
``interact_with_env(choice, content)``, each call one step; its result is the feedback (and, as UserRL shows it,
the step's reward). The agent's first message is the task as the gym poses it (the puzzle, the vague request, the
question). The prompts that describe each gym to the agent are this project's.

Every gym but FunctionGym asks an OpenAI-compatible model for its user's replies and its judge's verdicts, with its
own prompts. That model is the run's frozen simulator, behind this suite's ``UserProxy`` (started on first use, in
the process that steps the gyms): each episode has its own base URL (TauGym, whose tau-bench user reads one
process-wide URL, its own model name), the simulator's thinking is stripped from what the gym sees and kept for
CSD's coach, and every failure is recorded. A gym answers a failed call with a canned line worth reward 0 (an
outage, or a reply it could not parse); the step then ends the episode as an error, counted, never rewarded: a
failure the proxy saw, a gym's ``judge_success`` of False, IntentionGym's fallback evaluation, the canned lines of
TravelGym and TauGym. ``request_fields`` per gym go into every request (vLLM's ``structured_outputs`` holds a
simulator to the JSON a gym parses).

Options (``env_options``)::

    gyms: {FunctionGym: {weight: 190, split_file: F, config: {...}, request_fields: {...}}, TurtleGym: {}, ...}
    reward: train | eval        # TravelGym's elicitation / search bonuses differ between the two (below)
    test_fraction: 0.2          # of a gym without its own split: the share held out, by a hash of the task id
    max_steps: 16               # the gyms' own step limit (default: each gym's)
    timeout_s: 180              # per request of a gym (MIMESIS raised the gyms' 10 s: a slow reply became reward 0)
    concurrency: 32             # episodes stepping at once
    show_reward: true           # the step's reward after the feedback, as UserRL's tool shows it

A task id is ``Gym/id``. Splits: IntentionGym's and TauGym's data come in train and test files, which are the
splits; the others are split by ``split_file`` (JSON ``{"train": [ids], "test": [ids]}``) or by ``test_fraction``.
The mixture's weight defaults to the gym's number of tasks in the split (every task equally likely). The paper
evaluates an episode by the sum of its turns' rewards, TravelGym's by its best turn (``episode_score``).

What a gym does outside its episode is its own: each seeds the process-wide ``random`` and ``numpy.random`` modules
when it is built (with the episode's seed here) and prints its errors to stdout.
"""

import hashlib
import itertools
import json
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib import import_module
from pathlib import Path

from data_prep.render import END_MARKER
from megatron_mimesis.rl.envs.base import EnvScore, EnvStep, EnvTask, ToolCall

MISSING = ("UserRL's gyms are not on the package registries: install the ones named from a clone of "
           "SalesforceAIResearch/UserRL, e.g. pip install -e UserRL/gyms/{gym} (make venv installs them from "
           "../shared/third_party when present)")
TOOL_NAME = "interact_with_env"
SCORES = ("sum", "max")


def _feedback(obs: dict, info: dict) -> str:
    return obs["feedback"]


@dataclass(frozen=True)
class Gym:
    """How one gym is built, posed to the agent and read back."""

    package: str
    env_class: str
    config_class: str
    choices: dict[str, str]  # the action prefixes the agent may choose, and what each does
    about: str  # the environment, for the agent's system prompt
    tasks: Callable[[object], list[tuple[str, str]]]  # (task id, the gym's data_source for it) from its module
    opening: Callable[[dict, dict], str] = _feedback  # the reset's observation and info -> the first user message
    failed: Callable[[dict, dict], str | None] = lambda obs, info: None  # a canned failure, named
    files_split: Callable[[object], dict[str, set[str]]] | None = None  # the gym's own train/test files
    task_config: Callable[[str], dict] = lambda task_id: {}  # config fields a task needs besides data_source
    has_user: bool = True  # the gym calls a model (all but FunctionGym)
    user_by_model: bool = False  # the gym's user reads one process-wide URL: name the episode by its model
    end_marker: str = END_MARKER  # what the gym's user ends with
    modes: dict[str, dict] = field(default_factory=dict)  # config per reward mode ("train", "eval")
    prepare: Callable[[], None] = lambda: None  # before the gym is imported
    episode_score: str = "sum"  # how the paper scores an episode: the sum of its turn rewards, or its best turn


def _judged(obs: dict, info: dict) -> str | None:
    return None if info.get("judge_success", True) else f"the gym's judge failed: {obs['feedback']!r}"


def _intention_failed(obs: dict, info: dict) -> str | None:
    method = (info.get("reward_breakdown") or {}).get("method")
    return f"the gym's coverage evaluation failed ({method})" if method in ("fallback", "json_parse_error") else None


def _line(*lines: str):
    def failed(obs: dict, info: dict) -> str | None:
        return f"the gym's canned failure: {obs['feedback']!r}" if obs["feedback"].startswith(lines) else None
    return failed


def _records(module: str, loader: str, key: str = "id", source: str = "id"):
    """Tasks from a gym's own data loader ``module.loader()``: a list of records, each an id and a data_source."""
    def tasks(package) -> list[tuple[str, str]]:
        return [(str(r[key]), str(r[source])) for r in getattr(import_module(module), loader)()]
    return tasks


def _quiet_litellm() -> None:
    """tau-bench's user speaks through litellm, which otherwise downloads its price table at import (stalling offline
    nodes) and prints a provider list for a model name it does not know (every episode's, here)."""
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    import litellm

    litellm.suppress_debug_info = True


def _tau_tasks(package) -> list[tuple[str, str]]:
    data = Path(package.__file__).parent / "data"
    return [(t["id"], t["id"]) for name in ("tau_train.json", "tau_test.json")
            for t in json.loads((data / name).read_text())]


def _tau_split(package) -> dict[str, set[str]]:
    ids = {task_id for task_id, _ in _tau_tasks(package)}
    return {"train": {i for i in ids if "-train-" in i}, "test": {i for i in ids if "-train-" not in i}}


def _intention_split(package) -> dict[str, set[str]]:
    task_data = import_module("intentiongym.env.task_data")
    return {split: {str(t["id"]) for t in task_data.load_data_file(task_data.get_data_path() /
                                                                   f"all_intentions_{split}.json")}
            for split in ("train", "test")}


ASK = "ask the user a question (a yes/no question here), in content"
FINISH = "end the episode"
GYMS = {
    "FunctionGym": Gym(
        "functiongym", "FunctionEnv", "FunctionGymConfig",
        {"action": "evaluate the hidden function on four numbers written in content, e.g. '1 2 3 4'",
         "search": "with content 'test': show the test case, the four numbers to answer for",
         "answer": "submit, in content, the function's value on the test case", "finish": FINISH},
        "A hidden function maps four numbers a, b, c, d to one number. Find out what it does, then give its value "
        "on the test case.", _records("functiongym.data_loader", "load_functions"),
        opening=lambda obs, info: "I have a function of four numbers in mind. What is its value on the test case?",
        has_user=False),
    "TelepathyGym": Gym(
        "telepathygym", "TelepathyEnv", "TelepathyGymConfig",
        {"action": ASK + "; it answers Yes, No or Maybe", "answer": "guess, in content, what the user thinks of",
         "finish": FINISH},
        "The user is thinking of something (a person, an object, a concept) and answers yes/no questions about it. "
        "Work out what it is and guess it.", _records("telepathygym.env.entity_data", "load_entities"),
        opening=lambda obs, info: f"{obs['description']} {obs['goal']}", failed=_judged),
    "TurtleGym": Gym(
        "turtlegym", "StoryEnv", "TurtleGymConfig",
        {"action": ASK + " about the story; it answers Yes, No or Maybe",
         "answer": "explain, in content, what really happened; your explanation is scored by how much of the "
                   "hidden story it covers", "finish": FINISH},
        "A lateral-thinking puzzle (turtle soup): you see the strange surface of a story, the user knows what "
        "really happened. Find it out by asking, then explain it.",
        _records("turtlegym.env.story_data", "load_stories", source="title"),
        opening=lambda obs, info: f"{obs['story_title']}\n\n{obs['story_text']}\n\n{obs['goal']}", failed=_judged,
        modes={"train": {"success_threshold": 1.0}, "eval": {"success_threshold": 1.0}}),
    "IntentionGym": Gym(
        "intentiongym", "IntentionEnv", "IntentionGymConfig",
        {"action": "ask the user, in content, about what they want", "finish": FINISH},
        "The user has a task in mind but said only vaguely what it is. Ask what you need to know to do it well, "
        "one question at a time, until the missing details are clear.",
        _records("intentiongym.env.task_data", "load_tasks"), failed=_intention_failed,
        files_split=_intention_split),
    "PersuadeGym": Gym(
        "persuadegym", "PersuadeEnv", "PersuadeGymConfig",
        {"action": "argue, in content, against the user's view", "finish": FINISH},
        "The user strongly agrees with a claim. Change their mind with arguments; they answer and say where they "
        "stand now.", _records("persuadegym.env.statement_data", "load_statements"), failed=_judged),
    "SearchGym": Gym(
        "searchgym", "SearchEnv", "SearchGymConfig",
        {"search": "search the web for the query in content", "answer": "submit the answer in content",
         "finish": FINISH},
        "Answer the user's question; you may search the web first.",
        _records("searchgym.data_loader", "load_questions"), opening=lambda obs, info: obs["question"]),
    "TauGym": Gym(
        "taugym", "TauEnv", "TauGymConfig",
        {"search": "with content 'tools': list the tools you may call for the user",
         "action": "say, in content, something to the user",
         "answer": 'call a tool, content {"name": TOOL, "arguments": {...}}', "finish": FINISH},
        "You are a customer service agent. Serve the user's request with the domain's tools, following what the "
        "user asks for and confirms.", _tau_tasks, files_split=_tau_split,
        failed=_line("Error communicating with user:"), user_by_model=True, end_marker="###STOP###",
        prepare=_quiet_litellm,
        task_config=lambda task_id: {"task_category": task_id.split("-")[0],
                                     "task_split": "train" if "-train-" in task_id else "test"}),
    "TravelGym": Gym(
        "travelgym", "TravelEnv", "TravelGymConfig",
        {"action": "talk to the user, in content, to learn their preferences",
         "search": "search travel options (flights, hotels, restaurants, apartments, rental cars) for the query "
                   "in content", "answer": "recommend one option by its id, e.g. F3", "finish": FINISH},
        "Help the user plan a trip: learn their preferences, search the options, and recommend the best one of "
        "each kind they need.", _records("travelgym.env.task_data", "load_tasks"),
        failed=_line("I'm sorry, I'm not sure how to respond to your latest utterance right now."),
        modes={"train": {"preference_correct_reward": 0.8, "search_correct_reward": 0.0, "one_choice_per_aspect": True},
               "eval": {"preference_correct_reward": 0.6, "search_correct_reward": 0.2, "one_choice_per_aspect": True}},
        episode_score="max"),
}
REWARD_MODES = ("train", "eval")
GYM_OPTIONS = {"weight", "split_file", "config", "request_fields"}


class UserRLError(ValueError):
    """Bad options or a gym that cannot load; the message is the one line printed."""


def tool_schema(gym: Gym) -> dict:
    return {"name": TOOL_NAME,
            "description": "Act in the environment: one step, whose result is the environment's answer.",
            "parameters": {"type": "object", "required": ["choice", "content"], "properties": {
                "choice": {"type": "string", "enum": list(gym.choices)},
                "content": {"type": "string", "description": "what the chosen action says or asks"}}}}


def system_prompt(gym: Gym, show_reward: bool) -> str:
    choices = "\n".join(f"- {choice}: {what}" for choice, what in gym.choices.items())
    reward = " and the reward that step earned" if show_reward else ""
    return (f"{gym.about}\n\nYou act only through the tool {TOOL_NAME}(choice, content); each call is one step, and "
            f"its result is the environment's answer{reward}. The choices:\n{choices}\n\nThink, then act; a message "
            f"without a call ends the episode.")


class UserRLEnv:
    """One episode of a gym task. The gym itself is built when the episode opens, on the rank that steps it."""

    owns_user = True

    def __init__(self, suite: "UserRLSuite", name: str, task_id: str, data_source: str):
        self.suite, self.name, self.gym, self.data_source = suite, name, GYMS[name], data_source
        self.task = EnvTask(task_id=f"{name}/{task_id}", agent_system_prompt=system_prompt(self.gym, suite.show_reward),
                            tools=[tool_schema(self.gym)], user_instructions="")
        self._env = None
        self._key = None
        self.rewards: dict[str, float] = {}  # tool call id -> the step's reward
        self.steps = 0
        self.user_requests = 0
        self.user_seconds = 0.0

    def open(self, seed: int) -> EnvStep:
        options = self.suite.gym_options[self.name]
        fields = {"data_mode": "single", "data_source": self.data_source, "seed": seed % (1 << 31),
                  **({} if self.suite.max_steps is None else {"max_steps": self.suite.max_steps}),
                  **self.gym.task_config(self.data_source), **self.gym.modes.get(self.suite.reward, {})}
        if self.gym.has_user:
            proxy, self._key = self.suite.user_proxy(), self.suite.episode_key()
            base_url = proxy.open_episode(self._key, self.gym.end_marker, options.get("request_fields"), seed)
            if self.gym.user_by_model:
                fields.update(user_model=proxy.episode_model(self._key), user_provider="openai", api_key="EMPTY",
                              base_url=proxy.base_url)
            else:
                fields.update(model_name=self.suite.user_endpoint["model"], base_url=base_url, api_key="EMPTY",
                              timeout=self.suite.timeout_s)
        fields.update(options.get("config") or {})
        package = import_module(self.gym.package)
        try:
            self._env = getattr(package, self.gym.env_class)(getattr(package, self.gym.config_class)(**fields))
            obs, info = self._env.reset()
        except Exception as exc:  # a gym raises on its user's failure at reset (TauGym) and on bad configs
            return self._answered("", failed=f"reset failed: {exc!r}")
        return self._answered(self.gym.opening(obs, info))

    def step(self, call: ToolCall) -> EnvStep:
        choice, content = call.arguments.get("choice"), call.arguments.get("content", "")
        if not isinstance(content, str):  # a value the call's format read as JSON (a number, TauGym's tool call)
            content = json.dumps(content)
        if call.name != TOOL_NAME or choice not in self.gym.choices:
            return EnvStep(f"Error: call {TOOL_NAME} with choice one of {list(self.gym.choices)} and a content, "
                           f"not {call.name}({json.dumps(call.arguments)[:200]})")
        obs, reward, terminated, truncated, info = self._env.step(f"[{choice}] {content}")
        self.steps += 1
        text = obs["feedback"] + (f"\nReward: {float(reward):g}" if self.suite.show_reward else "")
        step = self._answered(text, bool(terminated or truncated), self.gym.failed(obs, info))
        if step.error is None:
            self.rewards[call.id] = float(reward)
        return step

    def _answered(self, text: str, done: bool = False, failed: str | None = None) -> EnvStep:
        """The gym's answer with what its user did meanwhile (the proxy's replies since the last answer): their
        thoughts beside it, or the failure, a failed request first, else the gym's own sign (``failed``)."""
        replies = self.suite.user_proxy().take(self._key) if self._key is not None else []
        self.user_requests += len(replies)
        self.user_seconds += sum(r.seconds for r in replies)
        errors = [r.error for r in replies if r.error is not None] + ([failed] if failed else [])
        if errors:
            return EnvStep("", error=f"{self.name}: {errors[0]}")
        return EnvStep(text, done, "\n\n".join(r.thinking for r in replies if r.thinking) or None)

    def close(self) -> None:
        if self._key is not None:
            self.suite.user_proxy().close_episode(self._key)
            self._key = None

    def score(self, messages: list[dict], termination: str) -> EnvScore:
        turn_rewards = [sum(self.rewards.get(c.id, 0.0) for c in m.get("tool_calls") or [])
                        for m in messages if m["role"] == "assistant"]
        score = episode_score(self.gym, turn_rewards)
        return EnvScore(turn_rewards, {"gym": self.name, "termination": termination, "steps": self.steps,
                                       "score": score, "success": score >= 1.0 - 1e-6,
                                       "user_requests": self.user_requests, "user_seconds": self.user_seconds})


def episode_score(gym: Gym, turn_rewards: list[float]) -> float:
    """The paper's episode score: the sum of the turns' rewards, or the best turn's (TravelGym)."""
    if not turn_rewards:
        return 0.0
    return max(turn_rewards) if gym.episode_score == "max" else sum(turn_rewards)


def _hashed_split(name: str, task_ids: list[str], test_fraction: float) -> dict[str, set[str]]:
    def held_out(task_id: str) -> bool:
        digest = hashlib.sha256(f"{name}/{task_id}".encode()).digest()
        return int.from_bytes(digest[:8], "big") / 2 ** 64 < test_fraction

    return {"train": {t for t in task_ids if not held_out(t)}, "test": {t for t in task_ids if held_out(t)}}


class UserRLSuite:
    """The gyms named in ``gyms`` (each with its options), their tasks loaded and split up front."""

    name = "userrl"
    owns_user = True
    trial_score = "max"

    def __init__(self, gyms: dict, reward: str = "train", test_fraction: float = 0.2, max_steps: int | None = None,
                 timeout_s: float = 180.0, concurrency: int = 32, show_reward: bool = True):
        if not isinstance(gyms, dict) or not gyms:
            raise UserRLError(f"env_options.gyms must name at least one gym of {sorted(GYMS)}")
        unknown = sorted(set(gyms) - set(GYMS))
        if unknown:
            raise UserRLError(f"env_options.gyms: {unknown} are not gyms of UserRL's {sorted(GYMS)}")
        if reward not in REWARD_MODES:
            raise UserRLError(f"env_options.reward must be one of {REWARD_MODES}, not {reward!r}")
        if not 0 <= test_fraction < 1:
            raise UserRLError(f"env_options.test_fraction must be in [0, 1), got {test_fraction}")
        if concurrency < 1 or timeout_s <= 0 or (max_steps is not None and max_steps < 1):
            raise UserRLError("env_options: concurrency and max_steps must be at least 1, timeout_s positive")
        self.gym_options = {name: dict(options or {}) for name, options in gyms.items()}
        self.reward, self.max_steps, self.timeout_s = reward, max_steps, timeout_s
        self.concurrency, self.show_reward = concurrency, show_reward
        self.user_endpoint: dict | None = None
        self._proxy = None
        self._episodes = itertools.count(1)
        self._lock = threading.Lock()  # episodes open on several threads
        self._tasks: dict[str, dict[str, str]] = {}  # gym -> task id -> data_source
        self._splits: dict[str, dict[str, set[str]]] = {}
        for name, options in self.gym_options.items():
            extra = sorted(set(options) - GYM_OPTIONS)
            if extra:
                raise UserRLError(f"env_options.gyms.{name}: {extra} are not options of a gym {sorted(GYM_OPTIONS)}")
            self._load(name, options, test_fraction)

    def _load(self, name: str, options: dict, test_fraction: float) -> None:
        gym = GYMS[name]
        try:
            gym.prepare()
            package = import_module(gym.package)
        except ModuleNotFoundError as exc:
            raise ImportError(f"{name} ({exc.name} is missing): {MISSING.format(gym=name)}") from exc
        except Exception as exc:  # SearchGym raises at import without a search key
            raise UserRLError(f"{name} does not import: {exc}") from None
        try:
            tasks = dict(gym.tasks(package))
        except (OSError, ValueError) as exc:  # a gym whose data files are not in the installed copy
            raise UserRLError(f"{name}: its tasks do not load ({exc}); its data files are not part of this copy of "
                              f"the gym") from None
        self._tasks[name] = tasks
        if options.get("split_file"):
            path = Path(options["split_file"])
            try:
                split = {k: set(map(str, v)) for k, v in json.loads(path.read_text()).items()}
            except (OSError, ValueError, TypeError) as exc:
                raise UserRLError(f"env_options.gyms.{name}.split_file {path}: {exc}") from None
            unknown = sorted(set().union(*split.values()) - set(tasks))
            if unknown:
                raise UserRLError(f"{path}: {len(unknown)} ids are not {name} tasks, e.g. {unknown[0]!r}")
        elif gym.files_split is not None:
            split = gym.files_split(package)
        else:
            split = _hashed_split(name, sorted(tasks), test_fraction)
        self._splits[name] = split

    # ------------------------------------------------------------------ the user
    def connect(self, base_url: str, model: str, api_key: str | None = None) -> "UserRLSuite":
        """The frozen simulator every gym's user and judge is (an OpenAI-compatible chat endpoint); the proxy in front
        of it starts on first use."""
        self.close()
        self.user_endpoint = {"base_url": base_url, "model": model, "api_key": api_key}
        return self

    def user_proxy(self):
        from megatron_mimesis.rl.envs.user_proxy import UserProxy

        with self._lock:
            if self._proxy is None:
                if self.user_endpoint is None:
                    raise RuntimeError("the userrl suite has no user endpoint: connect() it to the served simulator")
                self._proxy = UserProxy(self.user_endpoint["base_url"], self.user_endpoint["model"],
                                        timeout_s=self.timeout_s, api_key=self.user_endpoint["api_key"]).start()
            return self._proxy

    def episode_key(self) -> str:
        return f"e{os.getpid()}-{next(self._episodes)}"

    def close(self) -> None:
        if self._proxy is not None:
            self._proxy.stop()
            self._proxy = None

    # ------------------------------------------------------------------ tasks
    def task_ids(self, split: str) -> list[str]:
        return [task_id for ids, _ in self.mixture(split).values() for task_id in ids]

    def mixture(self, split: str) -> dict[str, tuple[list[str], float]]:
        if split not in ("train", "test"):
            raise KeyError(f"{self.name} has splits 'train' and 'test', not {split!r}")
        out = {}
        for name, options in self.gym_options.items():
            ids = sorted(self._splits[name].get(split, ()))
            weight = float(options.get("weight", len(ids)))
            if ids and weight > 0:
                out[name] = ([f"{name}/{i}" for i in ids], weight)
        return out

    def domain_of(self, task_id: str) -> str:
        return task_id.split("/", 1)[0]

    def make(self, task_id: str) -> UserRLEnv:
        name, _, gym_task = task_id.partition("/")
        return UserRLEnv(self, name, gym_task, self._tasks[name][gym_task])

    def episode_score(self, domain: str, turn_rewards: list[float]) -> float:
        return episode_score(GYMS[domain], turn_rewards)

