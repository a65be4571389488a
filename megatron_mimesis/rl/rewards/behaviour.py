"""Realistic-behaviour reward (ABCD task): an LLM judge rates how well the simulated user enacted a behaviour.

The judge rates four criteria in [0, 1] -- enactment e, placement/timing p, naturalness n, consistency c -- and
flags a simulator that describes the behaviour ("I am an impatient user") instead of enacting it. The reward is

    r = (2.0 e + 1.5 p + 1.0 n + 0.5 c) / 5.0, halved when described_instead_of_enacted.

The verdict is parsed strictly: a reply that is not exactly the requested JSON object is a failure (value None,
counted), never a guessed score, so a drifting judge shows up in the counters instead of in the policy.
"""

import json
import re

from megatron_mimesis.rl.rewards.judge import JudgeClient
from megatron_mimesis.rl.rewards.registry import RewardResult, ThreadSafeCounters, register
from megatron_mimesis.rl.simulator.prompts import PromptRecord
from megatron_mimesis.rl.types import Episode

WEIGHTS = {"e": 2.0, "p": 1.5, "n": 1.0, "c": 0.5}
FLAG = "described_instead_of_enacted"
KEYS = (*WEIGHTS, FLAG)

JUDGE_TEMPLATE = """You are evaluating a simulated user in a conversation with an AI assistant.
The simulated user was asked to realistically enact this behaviour:

Behaviour: {name}
Description: {description}

The simulated user's task instructions were:
<instructions>
{instructions}
</instructions>

The conversation (USER turns are the simulated user, ASSISTANT turns the assistant):
<conversation>
{conversation}
</conversation>

Rate only the USER turns, each criterion as a number from 0 to 1:
- "e" (enactment): how clearly the user actually exhibits the behaviour in what they say and do.
- "p" (placement/timing): whether the behaviour shows up at natural, well-chosen moments of the conversation.
- "n" (naturalness): how much the user sounds like a real person rather than a scripted or exaggerated one.
- "c" (consistency): whether the user stays consistent with the behaviour and their situation throughout.
- "described_instead_of_enacted": true if the user states or describes the behaviour (e.g. "I am being
  impatient") instead of showing it through their words and actions, otherwise false.

Reply with ONLY a JSON object with exactly these keys and nothing else, for example:
{{"e": 0.8, "p": 0.6, "n": 0.9, "c": 1.0, "described_instead_of_enacted": false}}"""

_FENCED = re.compile(r"\A```(?:json)?[ \t]*\n(.*)\n[ \t]*```\Z", re.DOTALL)


class VerdictError(ValueError):
    """The judge's reply is not exactly the requested JSON verdict."""


def behaviour_reward(e: float, p: float, n: float, c: float, described_instead_of_enacted: bool) -> float:
    r = (WEIGHTS["e"] * e + WEIGHTS["p"] * p + WEIGHTS["n"] * n + WEIGHTS["c"] * c) / 5.0
    return r / 2.0 if described_instead_of_enacted else r


def parse_verdict(reply: str) -> dict:
    """The whole reply, or the body of a reply that is a single ```json fenced block, must be a JSON object with
    exactly the keys e, p, n, c (numbers in [0, 1]) and described_instead_of_enacted (a bool)."""
    text = reply.strip()
    fenced = _FENCED.match(text)
    if fenced:
        text = fenced.group(1)
    try:
        verdict = json.loads(text)
    except json.JSONDecodeError as err:
        raise VerdictError(f"not JSON: {err.msg}") from None
    if not isinstance(verdict, dict):
        raise VerdictError(f"not a JSON object: {type(verdict).__name__}")
    if set(verdict) != set(KEYS):
        raise VerdictError(f"keys {sorted(verdict)} != {sorted(KEYS)}")
    for key in WEIGHTS:
        value = verdict[key]
        if isinstance(value, bool) or not isinstance(value, int | float) or not 0.0 <= value <= 1.0:
            raise VerdictError(f"{key!r} must be a number in [0, 1], got {value!r}")
    if not isinstance(verdict[FLAG], bool):
        raise VerdictError(f"{FLAG!r} must be true or false, got {verdict[FLAG]!r}")
    return verdict


def judge_messages(episode: Episode, prompt: PromptRecord) -> list[dict]:
    conversation = "\n\n".join(f"{m['role'].upper()}: {m['content']}" for m in episode.transcript)
    content = JUDGE_TEMPLATE.format(
        name=prompt.behavior.name,
        description=prompt.behavior.description,
        instructions=prompt.prompt,
        conversation=conversation,
    )
    return [{"role": "user", "content": content}]


class BehaviourReward:
    """Scores a batch of episodes with one concurrent ``JudgeClient.score_many`` call.

    ``counters``: ``scored`` (a value came back), ``judge_failures`` (no reply after retries), ``parse_failures``
    (a reply that is not a valid verdict), ``invalid_inputs`` (prompt without a behaviour or empty transcript).
    """

    def __init__(self, judge: JudgeClient):
        self.judge = judge
        self._counters = ThreadSafeCounters("scored", "judge_failures", "parse_failures", "invalid_inputs")

    @property
    def counters(self) -> dict[str, int]:
        return self._counters.snapshot()

    def score(self, episode: Episode, prompt: PromptRecord) -> RewardResult:
        return self.score_batch([episode], [prompt])[0]

    def score_batch(self, episodes: list[Episode], prompts: list[PromptRecord]) -> list[RewardResult]:
        results: list[RewardResult | None] = [None] * len(episodes)
        asked: list[int] = []
        for i, (episode, prompt) in enumerate(zip(episodes, prompts, strict=True)):
            if prompt.behavior is None:
                error = f"prompt {prompt.id!r} has no behavior to judge"
            elif not any(m["role"] == "user" for m in episode.transcript):
                error = "no simulator utterance in the transcript"
            else:
                asked.append(i)
                continue
            self._counters.add("invalid_inputs")
            results[i] = RewardResult(None, error=error)
        replies = self.judge.score_many([judge_messages(episodes[i], prompts[i]) for i in asked])
        for i, reply in zip(asked, replies, strict=True):
            results[i] = self._result(reply.text, reply.error, reply.cached)
        return results

    def _result(self, text: str | None, error: str | None, cached: bool) -> RewardResult:
        if text is None:
            self._counters.add("judge_failures")
            return RewardResult(None, {"judge_cached": cached}, f"judge: {error}")
        try:
            verdict = parse_verdict(text)
        except VerdictError as err:
            self._counters.add("parse_failures")
            return RewardResult(None, {"judge_reply": text, "judge_cached": cached}, f"unparseable verdict: {err}")
        self._counters.add("scored")
        return RewardResult(behaviour_reward(**verdict), {**verdict, "judge_cached": cached})


@register("behaviour")
def from_config(judge: dict) -> BehaviourReward:
    """Built from the run config's judge section: the keyword arguments of ``JudgeClient``."""
    return BehaviourReward(JudgeClient(**judge))
