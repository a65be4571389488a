"""The served simulator's end marker, in the words each client listens for.

A simulator is trained to end a conversation with one marker (``data_prep.render.END_MARKER``), but its clients
each listen for their own: tau2-bench's user convention ends on ``###STOP###``, an agent-RL user model on its
``stop_marker``, a UserRL gym on what its prompts ask for. This relay sits in front of ``vllm serve`` of the export
(``relay.Relay``) and rewrites the trained marker in the generated text of every completion it passes back: the
client's marker is the relay's ``--end-marker``, or a request's own ``"end_marker"`` field (taken out before the
request goes on). Everything else passes through as the server sent it: other endpoints, token ids and log-probs
(which keep the trained marker's tokens), the simulator's private thinking (``reasoning_content``), errors and their
statuses. Streamed requests (server-sent events) are relayed as they come, the marker rewritten even where it
straddles two events: a piece that could be the start of the marker is held back until the next one settles it.

    python -m megatron_mimesis.serving.marker_relay --upstream http://localhost:8000 --port 8001 \\
        --end-marker '###STOP###'       # then point the client at http://localhost:8001/v1

The relay is one process without children; SIGTERM or SIGINT stops it.
"""

import argparse
import os
import signal
import sys

from data_prep.render import END_MARKER
from megatron_mimesis.serving.relay import Exchange, Refused, Relay, TextStream, generated_texts

MARKER_FIELD = "end_marker"


def with_marker(payload: dict, path: str, marker: str) -> dict:
    """``payload`` (a completion response to ``path``) with the trained marker replaced by ``marker`` in its
    generated text."""
    if marker != END_MARKER:
        for holder, key in generated_texts(payload, path):
            holder[key] = holder[key].replace(END_MARKER, marker)
    return payload


class MarkerStream(TextStream):
    """``marker`` for every trained end marker in a text that arrives in pieces; the longest tail that could begin
    the trained marker waits for the next piece (never the replacement: what is sent is never scanned again)."""

    def __init__(self, marker: str):
        self.marker, self.held = marker, ""

    def feed(self, text: str) -> str:
        text, sent = self.held + text, []
        while (at := text.find(END_MARKER)) >= 0:
            sent += [text[:at], self.marker]
            text = text[at + len(END_MARKER):]
        keep = next((n for n in range(min(len(text), len(END_MARKER) - 1), 0, -1)
                     if END_MARKER.startswith(text[-n:])), 0)
        self.held = text[len(text) - keep:]
        return "".join(sent) + text[:len(text) - keep]

    def flush(self) -> str:
        held, self.held = self.held, ""
        return held


class MarkerRelay(Relay):
    streams = True

    def __init__(self, address: tuple[str, int], upstream: str, end_marker: str, timeout_s: float = 600.0,
                 api_key: str | None = None):
        if not end_marker.strip():
            raise ValueError("--end-marker must not be empty")
        self.end_marker = end_marker
        super().__init__(address, upstream, timeout_s, api_key)

    def prepare(self, path: str, request: dict | None) -> Exchange:
        marker = self.end_marker
        if request is not None:
            marker = request.pop(MARKER_FIELD, marker)
            if not isinstance(marker, str) or not marker.strip():
                raise Refused(400, f"{MARKER_FIELD} must be a non-empty string")
        return Exchange(path, request, {"marker": marker})

    def text_stream(self, exchange: Exchange) -> MarkerStream:
        return MarkerStream(exchange.context["marker"])

    def finish(self, exchange, status, payload, error, seconds):
        if status == 200 and payload is not None:
            return with_marker(payload, exchange.path, exchange.context["marker"])
        return payload


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m megatron_mimesis.serving.marker_relay",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--upstream", required=True, metavar="URL", help="the vllm serve root (http://host:port)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8001)
    parser.add_argument("--end-marker", default=END_MARKER,
                        help=f"what clients hear for the trained {END_MARKER} (tau2: ###STOP###); a request's "
                             f"{MARKER_FIELD} field overrides it")
    parser.add_argument("--timeout-s", type=float, default=600.0, help="per relayed request")
    parser.add_argument("--api-key", default=os.environ.get("MIMESIS_UPSTREAM_API_KEY"),
                        help="the upstream's key (vllm serve --api-key), sent in place of the client's (default: "
                             "$MIMESIS_UPSTREAM_API_KEY, else the client's own Authorization header)")
    args = parser.parse_args(argv)
    try:
        relay = MarkerRelay((args.host, args.port), args.upstream, args.end_marker, args.timeout_s, args.api_key)
    except (ValueError, OSError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    print(f"marker relay: {relay.base_url} -> {relay.upstream}, {END_MARKER} -> {args.end_marker}", flush=True)
    try:
        relay.serve_forever(poll_interval=0.2)
    except (KeyboardInterrupt, SystemExit):
        pass
    finally:
        relay.server_close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
