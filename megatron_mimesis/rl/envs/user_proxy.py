"""The frozen simulator in front of envs that call their user themselves (UserRL's gyms): one URL per episode.

A user-owning env asks an OpenAI-compatible endpoint for its user's replies and its judge's verdicts with its own
prompts and its own client. The run serves the simulator (``vllm serve`` of the export) and starts this proxy, a
real HTTP server on localhost (``serving.relay.Relay``), in front of it. Each episode gets its own base URL
(``/episodes/<key>/v1``), or, for a client that reads one process-wide URL (tau-bench's litellm user: its
``OPENAI_BASE_URL``), its own model name (``episode:<key>``), so that every request is known by its episode. On
the way there the proxy names the served model and adds the episode's request fields (e.g. vLLM's
``structured_outputs`` for an env that parses JSON) and a seed per request (the episode's seed, then its request
count: reproducible sampling). On the way back it:

* strips the simulator's thinking from what the env sees (``<think>`` blocks in the content, a reasoning parser's
  ``reasoning`` / ``reasoning_content``) and keeps it, with the public reply, for CSD's coach (:meth:`UserProxy.take`).
  The think markers are special tokens, which vLLM leaves out of the text by default: without a reasoning parser
  the thought and the reply would run together, so the proxy asks for them (``skip_special_tokens: false``, unless
  the episode's request fields say otherwise);
* writes the trained end marker as the env's client expects it (``end_marker``, e.g. tau-bench's ``###STOP###``);
* counts and times every request, and records every failure (an error status, no answer, a reply without content):
  an env answers those with a canned line worth reward 0, which the adapter turns into an episode error instead.

It binds to 127.0.0.1 unless told otherwise, and runs on a daemon thread of the process whose envs use it.
"""

import itertools
import re
import threading
from dataclasses import dataclass, field

from data_prep.render import END_MARKER
from megatron_mimesis.rl.chat import strip_thinking
from megatron_mimesis.serving.relay import Exchange, Refused, Relay, generated_texts

EPISODE_PATH = re.compile(r"^/episodes/([A-Za-z0-9_.-]+)(/.*)$")
EPISODE_MODEL = "episode:"
REASONING_FIELDS = ("reasoning_content", "reasoning")


@dataclass(frozen=True)
class UserReply:
    """One request of an episode's env, as answered: the simulator's private thinking, the public reply the env got,
    or the failure it met."""

    thinking: str | None
    reply: str | None
    error: str | None
    seconds: float


@dataclass
class _Episode:
    end_marker: str
    request_fields: dict
    seed: int | None
    requests: itertools.count = field(default_factory=itertools.count)
    replies: list[UserReply] = field(default_factory=list)  # since the last take


class UserProxy(Relay):
    """The proxy for the simulator served at ``upstream`` under the name ``model``."""

    def __init__(self, upstream: str, model: str, host: str = "127.0.0.1", port: int = 0, timeout_s: float = 600.0,
                 api_key: str | None = None):
        self.model = model
        self.episodes: dict[str, _Episode] = {}
        self.lock = threading.Lock()
        self.counts = {"requests": 0, "failures": 0, "seconds": 0.0}
        super().__init__((host, port), upstream, timeout_s, api_key)

    def open_episode(self, key: str, end_marker: str = END_MARKER, request_fields: dict | None = None,
                     seed: int | None = None) -> str:
        """Register an episode; its env's base URL. ``request_fields`` join every request of the episode."""
        if not EPISODE_PATH.match(f"/episodes/{key}/"):
            raise ValueError(f"episode key {key!r}: letters, digits, '_', '.' and '-' only")
        with self.lock:
            self.episodes[key] = _Episode(end_marker, dict(request_fields or {}), seed)
        return f"{self.root_url}/episodes/{key}/v1"

    def episode_model(self, key: str) -> str:
        """The model name that names the episode, for a client that cannot be given its own URL."""
        return f"{EPISODE_MODEL}{key}"

    def take(self, key: str) -> list[UserReply]:
        """The episode's requests answered (or failed) since the last ``take``."""
        with self.lock:
            episode = self.episodes[key]
            new, episode.replies = episode.replies, []
        return new

    def close_episode(self, key: str) -> None:
        """Forget the episode: a later request naming it is refused."""
        with self.lock:
            self.episodes.pop(key, None)

    def statistics(self) -> dict:
        """Requests, failures and their seconds since the proxy started (or since the last ``reset_statistics``)."""
        with self.lock:
            return dict(self.counts)

    def reset_statistics(self) -> None:
        with self.lock:
            self.counts = {"requests": 0, "failures": 0, "seconds": 0.0}

    # ------------------------------------------------------------------ relay hooks
    def prepare(self, path: str, request: dict | None) -> Exchange:
        match = EPISODE_PATH.match(path)
        key, upstream_path = (match.group(1), match.group(2)) if match else (None, path)
        if key is None and request is not None and str(request.get("model", "")).startswith(EPISODE_MODEL):
            key = request["model"].removeprefix(EPISODE_MODEL)
        with self.lock:
            episode = self.episodes.get(key) if key is not None else None
            if episode is None:
                raise Refused(404, f"unknown episode {key!r}: every request names its episode (by its URL "
                                   f"/episodes/<key>/v1 or the model {EPISODE_MODEL}<key>)", "not_found_error")
            index = next(episode.requests)
        if request is not None:
            request = {**request, "model": self.model, "skip_special_tokens": False, **episode.request_fields}
            if episode.seed is not None and "seed" not in episode.request_fields:
                request["seed"] = episode.seed * 1000 + index
        return Exchange(upstream_path, request, {"key": key, "episode": episode})

    def finish(self, exchange, status, payload, error, seconds):
        episode: _Episode = exchange.context["episode"]
        replies = []
        if status == 200 and payload is not None:
            for holder, key in generated_texts(payload, exchange.path):
                thinking, public = strip_thinking(holder[key])
                reasoning = [holder.pop(name) for name in REASONING_FIELDS if holder.get(name)]
                thinking = "\n\n".join(t for t in (*reasoning, thinking) if t) or None
                holder[key] = public.replace(END_MARKER, episode.end_marker)
                replies.append(UserReply(thinking, holder[key], None, seconds))
            if not replies and exchange.path.endswith(("/chat/completions", "/completions")):
                error = "reply without content"
        if status != 200 or error is not None and not replies:
            replies = [UserReply(None, None, error or f"status {status}", seconds)]
        with self.lock:
            episode.replies += replies
            self.counts["requests"] += 1
            self.counts["failures"] += any(r.error is not None for r in replies)
            self.counts["seconds"] += seconds
        return payload
