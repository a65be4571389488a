"""An HTTP relay in front of an OpenAI-compatible server (``vllm serve`` of a simulator), the one mechanism the
marker relay and the episode proxy share: each request goes to the upstream as the client sent it, except for what
the relay's hooks change on the way there and back.

vLLM cannot rewrite what a model generates nor tell one client from another, so what a client must hear differently
(another end marker, no private thinking) and what a run must know per client (which episode asked, what the
simulator thought, which request failed) happens here, in the generated text of whole completions:
``choices[].message.content`` of chat completions, ``choices[].text`` of completions. A streamed request (server-sent
events, which many agent frameworks send by default) is relayed only by a relay that can rewrite text arriving in
pieces (``streams``, :meth:`Relay.text_stream`: what it must rewrite can straddle two chunks); the others refuse it. Other
endpoints and fields pass through as served.

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
STREAMED_TEXT = {"/chat/completions": ("delta", "content"), "/completions": ("text",)}  # in each event's choices


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
    for _, holder, key in _choice_texts(payload, path, GENERATED_TEXT):
        if isinstance(holder.get(key), str):
            yield holder, key


def _choice_texts(payload: dict, path: str, table: dict, create: bool = False):
    """``(choice, holder, key)`` for each choice of ``payload`` whose text holder exists (or, with ``create``, is
    made): where its generated text is or goes, by ``table`` (:data:`GENERATED_TEXT`, :data:`STREAMED_TEXT`)."""
    keys = next((keys for suffix, keys in table.items() if path.endswith(suffix)), None)
    if keys is None:
        return
    for choice in payload.get("choices") or []:
        holder = choice
        for key in keys[:-1]:
            if not isinstance(holder.get(key), dict):
                if not create:
                    break
                holder[key] = {}
            holder = holder[key]
        else:
            yield choice, holder, keys[-1]


class TextStream:
    """Rewrites one choice's text as it arrives in pieces: :meth:`feed` returns what can be sent now, :meth:`flush`
    what was held back, at the end of the choice."""

    def feed(self, text: str) -> str:
        return text

    def flush(self) -> str:
        return ""


def error_payload(message: str, kind: str) -> dict:
    return {"error": {"type": kind, "message": message}}


class Relay(ThreadingHTTPServer):
    """An HTTP server on ``address`` relaying every request to ``upstream`` (the server's root URL, with or without
    its ``/v1``). With ``api_key`` the upstream gets that key in place of the client's: the gyms send ``Bearer EMPTY``,
    which a server started with ``vllm serve --api-key`` answers with 401."""

    daemon_threads = True
    streams = False  # relays streamed requests, each choice's text through :meth:`text_stream`; else refuses them

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

    def text_stream(self, exchange: Exchange) -> TextStream:
        """A fresh rewriter of one choice's streamed text (a relay with :attr:`streams`)."""
        return TextStream()

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
            if request is not None and request.get("stream") and not self.server.streams:
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
                status, content_type = answer.status, answer.headers.get("Content-Type", "")
                if status == 200 and content_type.startswith("text/event-stream"):
                    return self._stream(answer, exchange)
                data = answer.read()
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

    def _stream(self, answer, exchange: Exchange) -> None:
        """Relay server-sent events as they come, each choice's text through its own :class:`TextStream`; what a
        stream holds back goes out with its choice's last event (the one with a finish_reason), or in an event of
        its own before ``[DONE]``."""
        self.send_response(200)
        self.send_header("Content-Type", answer.headers.get("Content-Type"))
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Connection", "close")  # no length to announce: the end of the stream is the end of data
        self.end_headers()
        self.close_connection = True
        streams: dict[int, TextStream] = {}
        last: dict | None = None
        try:
            for line in answer:
                text = line.decode("utf-8")
                if text.startswith("data: ") and text.strip() != "data: [DONE]":
                    last = json.loads(text[len("data: "):])
                    self._rewrite_event(last, exchange, streams)
                    line = f"data: {json.dumps(last)}\n".encode()
                elif text.strip() == "data: [DONE]" and last is not None:
                    self._flush_streams(last, exchange, streams)
                self.wfile.write(line)
                self.wfile.flush()
        except (BrokenPipeError, ConnectionResetError):
            pass  # the client left; closing the upstream answer stops its generation

    def _rewrite_event(self, event: dict, exchange: Exchange, streams: dict) -> None:
        for choice, holder, key in _choice_texts(event, exchange.path, STREAMED_TEXT, create=True):
            stream = streams.setdefault(choice.get("index", 0), self.server.text_stream(exchange))
            text = stream.feed(holder[key]) if isinstance(holder.get(key), str) else None
            if choice.get("finish_reason") is not None:
                text = (text or "") + stream.flush()
            if text is not None:
                holder[key] = text

    def _flush_streams(self, last: dict, exchange: Exchange, streams: dict) -> None:
        """An event for each choice whose stream still holds text when the upstream ends without a finish_reason."""
        for index, stream in streams.items():
            held = stream.flush()
            if held:
                event = {**last, "choices": [{"index": index, "finish_reason": None}]}
                for _, holder, key in _choice_texts(event, exchange.path, STREAMED_TEXT, create=True):
                    holder[key] = held
                self.wfile.write(f"data: {json.dumps(event)}\n\n".encode())

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
