"""OpenAI-compatible LLM judge client: concurrent, retrying, and cached on disk.

Judge calls are the slow, paid part of a reward. Replies are deterministic requests (temperature 0), so each
successful reply is stored under the sha256 of (model, messages, temperature) and a rerun or resumed run reads it
back instead of asking again. Retries are done here rather than by the ``openai`` client (``max_retries=0``) so
that every retry is counted and shows up in the logs.
"""

import hashlib
import json
import os
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import openai

from megatron_mimesis.rl.rewards.registry import ThreadSafeCounters

_RETRYABLE = (openai.APIConnectionError, openai.InternalServerError, openai.RateLimitError)  # timeouts included
_TEMPERATURE = 0.0


@dataclass
class JudgeReply:
    text: str | None
    error: str | None
    cached: bool


class JudgeClient:
    """Scores chat requests against an OpenAI-compatible ``/v1/chat/completions`` endpoint.

    ``counters``: ``requests`` (requests asked for), ``cache_hits`` (of those, answered from disk), ``retries``
    (extra attempts after a timeout, connection error, 429 or 5xx), ``failures`` (requests that ended without a
    reply). Calls reaching the server = requests - cache_hits + retries.
    """

    def __init__(
        self,
        base_url: str,
        model: str,
        api_key: str | None = None,
        timeout_s: float = 60.0,
        max_retries: int = 4,
        backoff_s: float = 1.0,
        concurrency: int = 8,
        cache_dir: str | None = None,
    ):
        if concurrency < 1 or max_retries < 0 or timeout_s <= 0 or backoff_s < 0:
            raise ValueError("JudgeClient needs concurrency >= 1, max_retries >= 0, timeout_s > 0, backoff_s >= 0")
        self.model = model
        self.max_retries = max_retries
        self.backoff_s = backoff_s
        self.concurrency = concurrency
        self.cache_dir = Path(cache_dir) if cache_dir else None
        self._client = openai.OpenAI(
            base_url=base_url,
            api_key=api_key or os.environ.get("OPENAI_API_KEY") or "EMPTY",
            timeout=timeout_s,
            max_retries=0,
        )
        self._counters = ThreadSafeCounters("requests", "cache_hits", "retries", "failures")

    @property
    def counters(self) -> dict[str, int]:
        return self._counters.snapshot()

    def _cache_path(self, messages: list[dict]) -> Path | None:
        if self.cache_dir is None:
            return None
        key = json.dumps({"model": self.model, "messages": messages, "temperature": _TEMPERATURE}, sort_keys=True)
        digest = hashlib.sha256(key.encode("utf-8")).hexdigest()
        return self.cache_dir / digest[:2] / f"{digest}.json"

    def _read_cache(self, path: Path | None) -> str | None:
        """A missing or unreadable entry is a miss: the request is simply asked again and the entry rewritten."""
        if path is None or not path.exists():
            return None
        try:
            return json.loads(path.read_text(encoding="utf-8"))["text"]
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def _write_cache(self, path: Path | None, text: str) -> None:
        if path is None:
            return
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp.{os.getpid()}.{threading.get_ident()}")
        tmp.write_text(json.dumps({"text": text}), encoding="utf-8")
        os.replace(tmp, path)

    def _ask(self, messages: list[dict]) -> JudgeReply:
        self._counters.add("requests")
        path = self._cache_path(messages)
        cached = self._read_cache(path)
        if cached is not None:
            self._counters.add("cache_hits")
            return JudgeReply(cached, None, True)
        for attempt in range(self.max_retries + 1):
            if attempt:
                self._counters.add("retries")
                time.sleep(self.backoff_s * 2 ** (attempt - 1) * random.uniform(0.5, 1.5))
            try:
                response = self._client.chat.completions.create(
                    model=self.model, messages=messages, temperature=_TEMPERATURE
                )
            except _RETRYABLE as e:
                error = f"{type(e).__name__}: {e}"
                continue
            except openai.OpenAIError as e:
                self._counters.add("failures")
                return JudgeReply(None, f"{type(e).__name__}: {e}", False)
            text = response.choices[0].message.content if response.choices else None
            if not text:
                self._counters.add("failures")
                return JudgeReply(None, "judge returned no text", False)
            self._write_cache(path, text)
            return JudgeReply(text, None, False)
        self._counters.add("failures")
        return JudgeReply(None, f"gave up after {self.max_retries + 1} attempts: {error}", False)

    def score_many(self, requests: list[list[dict]]) -> list[JudgeReply]:
        """One reply per request, in order; at most ``concurrency`` requests in flight."""
        if not requests:
            return []
        with ThreadPoolExecutor(max_workers=min(self.concurrency, len(requests))) as pool:
            return list(pool.map(self._ask, requests))
