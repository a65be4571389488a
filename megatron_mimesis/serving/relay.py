"""An HTTP relay in front of an OpenAI-compatible server (``vllm serve`` of a simulator), the one mechanism the
marker relay and the episode proxy share: each request goes to the upstream as the client sent it, except for what
the relay's hooks change on the way there and back.

vLLM cannot rewrite what a model generates nor tell one client from another, so what a client must hear differently
(another end marker, no private thinking) and what a run must know per client (which episode asked, what the
simulator thought, which request failed) happens here, in the generated text of whole completions:
``choices[].message.content`` of chat completions, ``choices[].text`` of completions. Streamed requests are refused
(a marker or a think block can straddle two chunks); other endpoints and fields pass through as served.

A subclass implements :meth:`Relay.prepare` (the request: refuse it, or say what to forward) and :meth:`Relay.finish`
(the answer, or the failure: a status the upstream gave, or no answer at all). The server runs in one process without
children, its requests on daemon threads.
"""

import json
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

# headers of this hop only (urllib sets the length itself; a compressed answer could not be rewritten)
HOP_HEADERS = ("host", "content-length", "connection", "accept-encoding", "transfer-encoding")
GENERATED_TEXT = {"/chat/completions": ("message", "content"), "/completions": ("text",)}


class Refused(Exception):
    """A request the relay answers itself, with ``status`` and an OpenAI-style error ``message``."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.kind = status, message, kind


@dataclass
class Exchange:
    """One relayed request: the upstream path and JSON body to send, and what a subclass keeps for its answer."""

    path: str
    request: dict | None
    context: dict = field(default_factory=dict)


def generated_texts(payload: dict, path: str):
    """``(holder, key)`` of every generated text of a completion response to ``path``: ``holder[key]`` is the text."""
    keys = next((keys for suffix, keys in GENERATED_TEXT.items() if path.endswith(suffix)), None)
    if keys is None:
        return
    for choice in payload.get("choices") or []:
        holder = choice
        for key in keys[:-1]:
            holder = holder.get(key) or {}
        if isinstance(holder.get(keys[-1]), str):
            yield holder, keys[-1]


def error_payload(message: str, kind: str) -> dict:
    return {"error": {"type": kind, "message": message}}


class Relay(ThreadingHTTPServer):
    """An HTTP server on ``address`` relaying every request to ``upstream`` (the server's root URL, with or without
    its ``/v1``). With ``api_key`` the upstream gets that key in place of the client's: the gyms send ``Bearer EMPTY``,
    which a server started with ``vllm serve --api-key`` answers with 401."""

    daemon_threads = True

    def __init__(self, address: tuple[str, int], upstream: str, timeout_s: float = 600.0, api_key: str | None = None):
        self.upstream = upstream.rstrip("/").removesuffix("/v1")
        self.timeout_s = timeout_s
        self.api_key = api_key
        self.thread: threading.Thread | None = None
        super().__init__(address, _Handler)

    @property
    def root_url(self) -> str:
        return f"http://{self.server_address[0]}:{self.server_address[1]}"

    @property
    def base_url(self) -> str:
        return f"{self.root_url}/v1"

    def prepare(self, path: str, request: dict | None) -> Exchange:
        """The exchange to forward for a request to ``path`` (its JSON body, or None); raise :class:`Refused` to
        answer it here."""
        return Exchange(path, request)

    def finish(self, exchange: Exchange, status: int | None, payload: dict | None, error: str | None,
               seconds: float) -> dict | None:
        """The JSON answer to send back for a JSON answer of the upstream (``payload``, with its ``status``), or after
        a failure: ``status`` None means no answer at all (``error`` says why; the client gets a 502)."""
        return payload

    def start(self) -> "Relay":
        """Serve on a daemon thread of this process (a run's own relay); :meth:`stop` ends it."""
        self.thread = threading.Thread(target=self.serve_forever, kwargs={"poll_interval": 0.2}, daemon=True,
                                       name=type(self).__name__)
        self.thread.start()
        return self

    def stop(self) -> None:
        if self.thread is not None:
            self.shutdown()
            self.thread.join(timeout=10)
            self.thread = None
        self.server_close()

    def __enter__(self) -> "Relay":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


class _Handler(BaseHTTPRequestHandler):
    server: Relay
    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:
        self._relay(None)

    def do_POST(self) -> None:
        self._relay(self.rfile.read(int(self.headers.get("Content-Length", 0))))

    def _relay(self, body: bytes | None) -> None:
        request = None
        if body and self.headers.get("Content-Type", "").startswith("application/json"):
            try:
                request = json.loads(body)
            except json.JSONDecodeError:
                request = None
        if not isinstance(request, dict):
            request = None
        try:
            if request is not None and request.get("stream"):
                raise Refused(400, "this relay answers whole completions only: send the request without stream")
            exchange = self.server.prepare(self.path, request)
        except Refused as refused:
            return self._reply(refused.status, error_payload(refused.message, refused.kind))
        data = body if exchange.request is None else json.dumps(exchange.request).encode()
        dropped = HOP_HEADERS + (("authorization",) if self.server.api_key else ())
        headers = {k: v for k, v in self.headers.items() if k.lower() not in dropped}
        if self.server.api_key:
            headers["Authorization"] = f"Bearer {self.server.api_key}"
        forwarded = urllib.request.Request(f"{self.server.upstream}{exchange.path}", data=data, method=self.command,
                                           headers=headers)
        start = time.perf_counter()
        try:
            with urllib.request.urlopen(forwarded, timeout=self.server.timeout_s) as answer:
                status, content_type, data = answer.status, answer.headers.get("Content-Type", ""), answer.read()
        except urllib.error.HTTPError as error:
            status, content_type, data = error.code, error.headers.get("Content-Type", ""), error.read()
        except (urllib.error.URLError, TimeoutError, ConnectionError) as error:
            message = f"{self.server.upstream}: {getattr(error, 'reason', error)}"
            self.server.finish(exchange, None, None, message, time.perf_counter() - start)
            return self._reply(502, error_payload(message, "upstream_error"))
        seconds = time.perf_counter() - start
        if content_type.startswith("application/json"):
            try:
                payload = json.loads(data)
            except json.JSONDecodeError:
                payload = None
            if isinstance(payload, dict):
                error = None if status == 200 else json.dumps(payload.get("error", payload))[:500]
                data = json.dumps(self.server.finish(exchange, status, payload, error, seconds)).encode()
        elif status != 200:
            self.server.finish(exchange, status, None, data[:500].decode(errors="replace"), seconds)
        self._send(status, content_type, data)

    def _reply(self, status: int, payload: dict) -> None:
        self._send(status, "application/json", json.dumps(payload).encode())

    def _send(self, status: int, content_type: str, data: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type or "application/octet-stream")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args) -> None:  # one line per event on the console, not one per request
        pass
