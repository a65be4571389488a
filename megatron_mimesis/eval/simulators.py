"""The simulators under evaluation, built from ``NAME=SPEC`` and all answering the same two questions.

* ``reply(positions, seed)``: the simulator's own next user turn at each held-out position (seeded sampling);
* ``scorer(samples, targets)``: log-probs of given tokens (the teacher-forced likelihood), or
  :class:`LikelihoodUnavailable` with the reason.

SPEC is one of

* ``hf:DIR``: an HF checkpoint, sampled in this process (the rollout engines' :class:`HFEngine`);
* ``ckpt:DIR``: a megatron dist checkpoint at any TP/PP layout (a save root, whose ``latest`` is used, or one
  ``iter_N`` directory), exported to a temporary HF directory by the project's converter and then as ``hf:``;
* ``openai:URL@MODEL``: an OpenAI-compatible server. With a tokenizer (``--tokenizer``, or MODEL naming a
  directory) it is our simulator served (``vllm serve`` of an export): prompts go out as token ids of the
  training rendering on ``/v1/completions`` and the likelihood comes from prompt log-probs (``echo``), where
  the server offers them. Without one it is a chat model playing the user from a prompt template: the
  conversation is sent in the user-simulator convention (``rl.chat.flip_roles``: the model speaks as the
  "assistant" of the API) and there is no likelihood.

Every reply goes through the project's chat conventions: thinking is split off and never scored, the stop
marker ``<END>`` means the user ended the conversation, and a failed request or an empty utterance comes back as
an error, which the evaluation counts and excludes.
"""

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path

import openai
import torch

from data_prep.render import END_MARKER
from megatron_mimesis.eval.likelihood import LikelihoodUnavailable
from megatron_mimesis.rl.agent.user_models import EngineUserModel, OpenAIUserModel
from megatron_mimesis.rl.chat import ChatRenderer, flip_roles, strip_thinking
from megatron_mimesis.rl.engines.protocol import request_seeds
from megatron_mimesis.rl.types import SamplingParams

KINDS = ("hf", "ckpt", "openai")
USER_TEMPLATE = Path(__file__).with_name("templates") / "play_the_user.txt"


class SpecError(ValueError):
    """A ``--simulator`` that cannot be used; the message is the one line printed."""


@dataclass(frozen=True)
class Reply:
    text: str  # the public utterance, stop marker removed
    ended: bool
    error: str | None = None


@dataclass(frozen=True)
class Spec:
    name: str
    kind: str
    target: str  # a directory, or the base URL
    model: str = ""  # the served model's name (openai)
    tokenizer: str | None = None  # tokenizer directory (hf, ckpt: the checkpoint's own unless given)


def parse_spec(text: str, tokenizer: str | None) -> Spec:
    name, eq, spec = text.partition("=")
    if not eq or not name or not spec:
        raise SpecError(f"--simulator {text!r}: expected NAME=SPEC")
    if name == "human":
        raise SpecError("--simulator human: the name is taken by the humans' own row")
    kind, colon, target = spec.partition(":")
    where = f"--simulator {name}"
    if not colon or kind not in KINDS or not target:
        raise SpecError(f"{where}: SPEC must be one of {', '.join(k + ':...' for k in KINDS)}, not {spec!r}")
    if kind == "hf":
        if not (Path(target) / "config.json").is_file():
            raise SpecError(f"{where}: {target} is not an HF checkpoint directory (no config.json)")
        return Spec(name, kind, target, tokenizer=tokenizer_dir(where, tokenizer or target))
    if kind == "ckpt":
        from megatron_mimesis.checkpoint.reader import TOKENIZER_SUBDIR, CheckpointError, resolve_checkpoint_dir

        try:
            directory = resolve_checkpoint_dir(target)
        except (CheckpointError, FileNotFoundError, ValueError) as err:
            raise SpecError(f"{where}: {err}") from None
        if tokenizer is None and not (directory / TOKENIZER_SUBDIR).is_dir():
            raise SpecError(f"{where}: {directory} has no tokenizer saved with it (pass --tokenizer DIR)")
        return Spec(name, kind, target, tokenizer=tokenizer_dir(where, tokenizer) if tokenizer else None)
    base_url, at, model = target.rpartition("@")
    if not at or not model or not base_url.startswith(("http://", "https://")):
        raise SpecError(f"{where}: expected openai:BASE_URL@MODEL with an http(s) URL, not {spec!r}")
    served = tokenizer or (model if Path(model).is_dir() else None)
    return Spec(name, kind, base_url, model, tokenizer_dir(where, served) if served else None)


def tokenizer_dir(where: str, path: str) -> str:
    if not (Path(path) / "tokenizer_config.json").is_file():
        raise SpecError(f"{where}: no tokenizer in {path} (pass --tokenizer DIR)")
    return path


def parse_specs(texts: list[str], tokenizer: str | None) -> list[Spec]:
    specs = [parse_spec(t, tokenizer) for t in texts]
    names = [s.name for s in specs]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise SpecError(f"--simulator names must be unique; repeated: {', '.join(duplicates)}")
    return specs


def to_reply(thinking_and_text: tuple[str | None, str], error: str | None = None) -> Reply:
    if error is not None:
        return Reply("", False, error)
    text = thinking_and_text[1]
    ended = END_MARKER in text
    text = text.replace(END_MARKER, "").strip()
    if not text and not ended:
        return Reply("", False, "empty utterance")
    return Reply(text, ended)


@dataclass
class Settings:
    """How every simulator samples: one setting for all, so that rows differ only by the model."""

    max_new_tokens: int
    temperature: float
    thinking: bool  # render prompts with the thinking template (an SFT'd simulator); off as mid-trained
    request_timeout: float
    concurrency: int
    seed: int


def position_seed(seed: int, key: str) -> int:
    """The sampling seed of one position: a function of the run's seed and the position alone, so a reply does
    not depend on which other positions were asked with it (a resumed run samples the same)."""
    return request_seeds(f"eval-simulator {seed} {key}", 1)[0] >> 32


class EngineSimulator:
    """A simulator sampled from token-id prompts of the training rendering (an in-process model or a server)."""

    def __init__(self, name: str, engine, tokenizer, tokenizer_path: str, settings: Settings, scorer,
                 concurrency: int):
        self.name = name
        self.engine = engine
        self.tokenizer_dir = tokenizer_path
        self.renderer = ChatRenderer(tokenizer, thinking=settings.thinking)
        self.sampling = SamplingParams(max_new_tokens=settings.max_new_tokens, temperature=settings.temperature,
                                       stop_token_ids=self.renderer.stop_token_ids)
        self.scorer = scorer
        self.concurrency = concurrency

    def reply(self, positions, seed: int) -> list[Reply]:
        def one(position) -> Reply:
            prompt = self.renderer.user_prompt(list(position.context))
            sampling = replace(self.sampling, seed=position_seed(seed, position.key))
            generation = self.engine.generate([prompt], sampling)[0]
            error = generation.finish_reason if generation.finish_reason.startswith("error") else None
            return to_reply(self.renderer.split_thinking(generation.text), error)

        with ThreadPoolExecutor(max_workers=self.concurrency) as pool:
            return list(pool.map(one, positions))

    def user_model(self):
        """The simulator as the user of agent episodes (calibration)."""
        return EngineUserModel(self.engine, self.renderer, self.sampling)


class ChatSimulator:
    """A chat model playing the user: the template is its system prompt, the human's side its own turns."""

    tokenizer_dir = None

    def __init__(self, name: str, base_url: str, model: str, settings: Settings, template: Path = USER_TEMPLATE):
        self.name = name
        self.client = openai.OpenAI(base_url=base_url, api_key="EMPTY", timeout=settings.request_timeout,
                                    max_retries=3)
        self.base_url = base_url
        self.model = model
        self.settings = settings
        self.system = template.read_text().replace("{stop_marker}", END_MARKER)

    def reply(self, positions, seed: int) -> list[Reply]:
        with ThreadPoolExecutor(max_workers=self.settings.concurrency) as pool:
            return list(pool.map(self._reply, positions, [position_seed(seed, p.key) for p in positions]))

    def _reply(self, position, seed: int) -> Reply:
        messages = [{"role": "system", "content": self.system}, *flip_roles(list(position.context))]
        if len(messages) == 1:
            messages.append({"role": "user", "content": "(You open the conversation.)"})
        try:
            response = self.client.chat.completions.create(
                model=self.model, messages=messages, max_tokens=self.settings.max_new_tokens,
                temperature=self.settings.temperature, seed=seed)
        except openai.OpenAIError as error:
            return to_reply((None, ""), f"{type(error).__name__}: {error}")
        if not response.choices or response.choices[0].message.content is None:
            return to_reply((None, ""), "reply without content")
        return to_reply(strip_thinking(response.choices[0].message.content))

    def user_model(self):
        """The chat model as the user of agent episodes (calibration): the task's scenario is its prompt."""
        return OpenAIUserModel(self.base_url, self.model,
                               max_tokens=self.settings.max_new_tokens, temperature=self.settings.temperature,
                               timeout_s=self.settings.request_timeout, concurrency=self.settings.concurrency)

    def scorer(self, samples, targets):
        raise LikelihoodUnavailable("a chat model playing the user has no log-probs of the human's text")


def hf_scorer(model):
    """Log-probs of the target tokens from one forward per sample, keeping only the logits that predict them."""

    @torch.no_grad()
    def score(samples: list[list[int]], targets: list[list[int]]) -> list[list[float]]:
        device = next(model.parameters()).device
        out = []
        for tokens, positions in zip(samples, targets, strict=True):
            keep = torch.tensor([t - 1 for t in positions], device=device)
            logits = model(input_ids=torch.tensor([tokens], device=device), logits_to_keep=keep).logits[0].float()
            logprobs = torch.log_softmax(logits, dim=-1)
            wanted = torch.tensor([tokens[t] for t in positions], device=device)
            out.append(logprobs.gather(1, wanted[:, None])[:, 0].tolist())
        return out

    return score


def echo_scorer(client, model: str, base_url: str, concurrency: int):
    """Prompt log-probs from ``/v1/completions`` with ``echo`` (vLLM and the legacy OpenAI API offer it)."""

    def one(tokens: list[int], positions: list[int]) -> list[float]:
        try:
            response = client.completions.create(model=model, prompt=list(tokens), max_tokens=1, echo=True,
                                                 logprobs=0, temperature=0.0)
        except openai.BadRequestError as error:
            raise LikelihoodUnavailable(f"{base_url} refuses prompt log-probs: {error}") from None
        except openai.OpenAIError as error:
            raise LikelihoodUnavailable(f"{base_url}: {type(error).__name__}: {error}") from None
        logprobs = response.choices[0].logprobs if response.choices else None
        values = getattr(logprobs, "token_logprobs", None)
        if not values or len(values) < len(tokens) or any(values[t] is None for t in positions):
            raise LikelihoodUnavailable(f"{base_url} returned no prompt log-probs")
        return [float(values[t]) for t in positions]

    def score(samples, targets):
        with ThreadPoolExecutor(max_workers=concurrency) as pool:
            return list(pool.map(one, samples, targets))

    return score


def build(spec: Spec, settings: Settings, workdir: Path):
    """The simulator of ``spec``; a ``ckpt:`` one is exported under ``workdir`` first (removed by the caller)."""
    from transformers import AutoTokenizer

    if spec.kind == "openai" and spec.tokenizer is None:
        return ChatSimulator(spec.name, spec.target, spec.model, settings)
    if spec.kind == "openai":
        from megatron_mimesis.rl.engines.openai import OpenAICompletionsEngine

        tokenizer = AutoTokenizer.from_pretrained(spec.tokenizer)
        engine = OpenAICompletionsEngine(spec.target, spec.model, tokenizer, timeout_s=settings.request_timeout,
                                         concurrency=settings.concurrency, seed=settings.seed, errors="return")
        scorer = echo_scorer(engine.client, spec.model, spec.target, settings.concurrency)
        return EngineSimulator(spec.name, engine, tokenizer, spec.tokenizer, settings, scorer, settings.concurrency)
    from megatron_mimesis.rl.engines.hf import HFEngine

    path, tokenizer_path = spec.target, spec.tokenizer
    if spec.kind == "ckpt":
        path = str(export_checkpoint(spec.target, workdir / spec.name, spec.tokenizer))
        tokenizer_path = tokenizer_path or path
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
    engine = HFEngine.from_pretrained(path, tokenizer=tokenizer, dtype=torch.float32, seed=settings.seed)
    return EngineSimulator(spec.name, engine, tokenizer, tokenizer_path, settings, hf_scorer(engine.model), 1)


def export_checkpoint(checkpoint: str, out: Path, tokenizer: str | None) -> Path:
    """A dist checkpoint (any layout) as an fp32 HF directory, through the one converter (no process group), with
    the given tokenizer, else the one saved with the checkpoint."""
    from megatron_mimesis.checkpoint.conversion import export_to_hf

    out.parent.mkdir(parents=True, exist_ok=True)
    return export_to_hf(checkpoint, out, tokenizer=tokenizer, dtype="fp32", progress=False)
