"""The records that flow through RL: what an engine generates, what an episode is made of, what the trainer
consumes. Plain dataclasses shared by the engines, the episode runner, the rewards and the RL step."""

from dataclasses import dataclass, field


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None


@dataclass
class Generation:
    """One sampled continuation: its token ids, decoded text, the sampler's log-prob of each token, and why it
    stopped ("stop": a stop token, included as the last id; "length": max_new_tokens reached)."""

    token_ids: list[int]
    text: str
    logprobs: list[float]
    finish_reason: str
    # the policy version (updates applied) whose weights sampled it, where the engine runs behind the trainer
    # (``max_staleness``); None: the trainer's current weights
    policy_version: int | None = None


@dataclass
class PolicyTurn:
    """One turn the policy (the simulator, speaking as the user) produced inside an episode.

    ``context_ids`` is exactly what the policy saw (the prompt it was sampled from); ``response_ids`` what it
    sampled, ``thinking`` / ``utterance`` the split of its text (only ``utterance`` reaches the counterpart).
    """

    context_ids: list[int]
    response_ids: list[int]
    response_logprobs: list[float]
    thinking: str | None
    utterance: str
    finish_reason: str
    policy_version: int | None = None  # the generation's


@dataclass
class Episode:
    """One rollout: a conversation between the policy and a counterpart for one prompt."""

    prompt_id: str
    domain: str
    group_id: int  # the prompt's index within the step: rollouts of one prompt share it
    rollout_id: int  # unique within the step
    turns: list[PolicyTurn] = field(default_factory=list)
    transcript: list[dict] = field(default_factory=list)  # public messages only: {"role", "content"}
    finished: str = ""  # "stop_marker", "max_turns", "counterpart_done", "error: ..."
    reward: float | None = None  # None until scored; stays None when scoring failed
    reward_info: dict = field(default_factory=dict)


@dataclass
class TrainingRow:
    """One policy turn as a training sample (FoldGRPO: several rows of one rollout share its rollout_id).

    ``response_logprobs`` are the update's old log-probs: the sampler's when it is the training model itself, else
    the trainer's recomputed ones, and then ``engine_logprobs`` keeps the sampler's beside them (rollout correction
    weighs each token by the ratio of the two)."""

    group_id: int
    rollout_id: int
    context_ids: list[int]
    response_ids: list[int]
    response_logprobs: list[float]
    reward: float
    domain: str
    engine_logprobs: list[float] | None = None
    policy_version: int | None = None  # its turn's generation's
