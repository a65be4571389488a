"""The judge client against a real OpenAI-compatible HTTP server on localhost: replies, retries on 5xx, timeouts
and refused connections (each counted), the disk cache (a rerun sends nothing), and the concurrency bound."""

import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from megatron_mimesis.rl.rewards import rewards_for
from megatron_mimesis.rl.rewards.judge import JudgeClient
from megatron_mimesis.rl.simulator.prompts import Behavior, PromptRecord
from megatron_mimesis.rl.types import Episode

VERDICT = '{"e": 1, "p": 0.5, "n": 0, "c": 0, "described_instead_of_enacted": true}'  # r = 0.55 / 2


class FakeJudgeServer:
    """``/v1/chat/completions`` on 127.0.0.1:<ephemeral>. Each request takes the next mode of ``script`` (then
    ``default``): "good" (the VERDICT), "garbage" (prose), "500", "400", "slow" (sleeps past the client timeout,
    then answers), "hold" (answers after 0.15 s, so concurrent requests overlap). It serves from a bounded loop
    that ends on ``stop()`` or after 30 s, whichever comes first."""

    def __init__(self, default="good", script=()):
        self.default = default
        self.script = list(script)
        self.hits = 0
        self.in_flight = 0
        self.max_in_flight = 0
        self.bodies = []
        self.auth = []
        self.lock = threading.Lock()
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.server.daemon_threads = True
        self.server.timeout = 0.05
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self):
        deadline = time.monotonic() + 30.0
        while not self._stop.is_set() and time.monotonic() < deadline:
            self.server.handle_request()

    def stop(self):
        self._stop.set()
        self._thread.join(timeout=5)
        self.server.server_close()

    def _next_mode(self, body, auth):
        with self.lock:
            self.hits += 1
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
            self.bodies.append(body)
            self.auth.append(auth)
            return self.script.pop(0) if self.script else self.default

    def _handler(self):
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _send(self, status, payload):
                data = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                mode = fake._next_mode(body, self.headers.get("Authorization"))
                try:
                    if mode in ("500", "400"):
                        self._send(int(mode), {"error": {"message": f"fake {mode}", "type": "server_error"}})
                        return
                    time.sleep({"slow": 1.0, "hold": 0.15}.get(mode, 0.0))
                    text = "The user seemed impatient; 8/10." if mode == "garbage" else VERDICT
                    self._send(
                        200,
                        {
                            "id": "c1",
                            "object": "chat.completion",
                            "created": 0,
                            "model": body["model"],
                            "choices": [
                                {"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": text}}
                            ],
                            "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
                        },
                    )
                except (BrokenPipeError, ConnectionResetError):  # the client gave up (timeout)
                    pass
                finally:
                    with fake.lock:
                        fake.in_flight -= 1

        return Handler


@pytest.fixture
def serve():
    servers = []

    def start(**kwargs):
        servers.append(FakeJudgeServer(**kwargs))
        return servers[-1]

    yield start
    for server in servers:
        server.stop()


def ask(i):
    return [{"role": "user", "content": f"rate conversation {i}"}]


def client(server, **kwargs):
    return JudgeClient(server.url, "judge-model", **{"backoff_s": 0.01, **kwargs})


def test_good_replies_in_order(serve, monkeypatch):
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    server = serve()
    judge = client(server)
    replies = judge.score_many([ask(0), ask(1), ask(2)])
    assert [(r.text, r.error, r.cached) for r in replies] == [(VERDICT, None, False)] * 3
    assert sorted(b["messages"][0]["content"] for b in server.bodies) == [ask(i)[0]["content"] for i in range(3)]
    assert {(b["model"], b["temperature"]) for b in server.bodies} == {("judge-model", 0.0)}
    assert set(server.auth) == {"Bearer EMPTY"}
    assert judge.counters == {"requests": 3, "cache_hits": 0, "retries": 0, "failures": 0}
    assert judge.score_many([]) == []


def test_cache_spares_the_second_request(serve, tmp_path):
    server = serve()
    first = client(server, cache_dir=str(tmp_path)).score_many([ask(0)])
    assert first[0].cached is False and server.hits == 1

    resumed = client(server, cache_dir=str(tmp_path))  # a new process reading the same cache
    again = resumed.score_many([ask(0), ask(1)])
    assert [(r.text, r.cached) for r in again] == [(VERDICT, True), (VERDICT, False)]
    assert server.hits == 2
    assert resumed.counters == {"requests": 2, "cache_hits": 1, "retries": 0, "failures": 0}

    other_model = JudgeClient(server.url, "other-model", cache_dir=str(tmp_path))
    assert other_model.score_many([ask(0)])[0].cached is False and server.hits == 3


def test_http_500_then_success_is_retried(serve, tmp_path):
    server = serve(script=["500", "good"])
    judge = client(server, cache_dir=str(tmp_path))
    (reply,) = judge.score_many([ask(0)])
    assert (reply.text, reply.error) == (VERDICT, None)
    assert server.hits == 2
    assert judge.counters == {"requests": 1, "cache_hits": 0, "retries": 1, "failures": 0}


def test_persistent_500_gives_up_and_400_is_not_retried(serve, tmp_path):
    server = serve(default="500")
    judge = client(server, max_retries=2, cache_dir=str(tmp_path))
    (reply,) = judge.score_many([ask(0)])
    assert reply.text is None and reply.error.startswith("gave up after 3 attempts: InternalServerError")
    assert server.hits == 3
    assert judge.counters == {"requests": 1, "cache_hits": 0, "retries": 2, "failures": 1}
    assert not list(tmp_path.rglob("*.json"))  # failures are never cached

    server = serve(default="400")
    judge = client(server, max_retries=2)
    (reply,) = judge.score_many([ask(0)])
    assert reply.text is None and reply.error.startswith("BadRequestError")
    assert server.hits == 1
    assert judge.counters == {"requests": 1, "cache_hits": 0, "retries": 0, "failures": 1}


def test_timeout_is_retried_then_counted_as_failure(serve):
    server = serve(script=["slow", "good"])
    judge = client(server, timeout_s=0.3, max_retries=1)
    assert judge.score_many([ask(0)])[0].text == VERDICT
    assert judge.counters["retries"] == 1

    server = serve(default="slow")
    judge = client(server, timeout_s=0.3, max_retries=1)
    (reply,) = judge.score_many([ask(0)])
    assert reply.text is None and "APITimeoutError" in reply.error
    assert server.hits == 2
    assert judge.counters == {"requests": 1, "cache_hits": 0, "retries": 1, "failures": 1}


def test_refused_connection_is_retried():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    judge = JudgeClient(f"http://127.0.0.1:{port}/v1", "m", max_retries=1, backoff_s=0.01)
    (reply,) = judge.score_many([ask(0)])
    assert reply.text is None and "APIConnectionError" in reply.error
    assert judge.counters == {"requests": 1, "cache_hits": 0, "retries": 1, "failures": 1}


def test_concurrency_bound(serve):
    server = serve(default="hold")
    judge = client(server, concurrency=3)
    replies = judge.score_many([ask(i) for i in range(12)])
    assert all(r.text == VERDICT for r in replies)
    assert server.hits == 12
    assert server.max_in_flight == 3


def test_behaviour_reward_end_to_end(serve, tmp_path):
    server = serve(script=["good", "garbage"])
    judge_config = {"base_url": server.url, "model": "judge-model", "cache_dir": str(tmp_path), "concurrency": 1}
    reward = rewards_for({"abcd": "behaviour"}, {"behaviour": {"judge": judge_config}})["abcd"]
    prompt = PromptRecord("b1", "abcd", "Book a flight.", behavior=Behavior("impatience", "gets short"))
    episodes = [
        Episode("b1", "abcd", 0, i, transcript=[{"role": "assistant", "content": "Hi"}, {"role": "user", "content": u}])
        for i, u in enumerate(["Hurry up, I don't have all day.", "Can you just book it already?"])
    ]
    results = reward.score_batch(episodes, [prompt, prompt])
    assert results[0].value == pytest.approx(0.275) and results[0].error is None
    assert results[1].value is None and results[1].error.startswith("unparseable verdict: not JSON")
    assert reward.counters == {"scored": 1, "judge_failures": 0, "parse_failures": 1, "invalid_inputs": 0}
    assert reward.judge.counters == {"requests": 2, "cache_hits": 0, "retries": 0, "failures": 0}
