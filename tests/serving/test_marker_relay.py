"""The marker relay as a user starts it (``python -m megatron_mimesis.serving.marker_relay``), in front of an
OpenAI-compatible server that answers with the trained marker: what each client hears, what passes untouched,
and how the process ends. The same relay in front of a real ``vllm serve`` of a trained export is in
``tests/checkpoint/test_served_simulator.py``."""

import json
import signal
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from data_prep.render import END_MARKER
from megatron_mimesis.rl.agent.user_models import OpenAIUserModel
from tests.rl.fakes import FakeOpenAIServer

REPO_ROOT = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Relay:
    def __init__(self, upstream: str, *args: str):
        self.port = _free_port()
        self.proc = subprocess.Popen([sys.executable, "-m", "megatron_mimesis.serving.marker_relay", "--upstream",
                                      upstream, "--port", str(self.port), *args], cwd=REPO_ROOT,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.banner = self.proc.stdout.readline()
        self.base_url = f"http://127.0.0.1:{self.port}/v1"

    def post(self, path: str, body: dict) -> tuple[int, dict]:
        request = urllib.request.Request(f"{self.base_url}{path}", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=30) as answer:
                return answer.status, json.loads(answer.read())
        except urllib.error.HTTPError as error:
            return error.code, json.loads(error.read())

    def stream(self, path: str, body: dict) -> tuple[list[str], str]:
        """The non-empty text pieces of a streamed request (server-sent events until ``[DONE]``) and its
        finish_reason."""
        request = urllib.request.Request(f"{self.base_url}{path}", data=json.dumps({**body, "stream": True}).encode(),
                                         headers={"Content-Type": "application/json"})
        pieces, finish = [], None
        with urllib.request.urlopen(request, timeout=30) as answer:
            assert answer.headers["Content-Type"].startswith("text/event-stream")
            lines = [line.decode().strip() for line in answer if line.strip()]
        assert lines[-1] == "data: [DONE]"
        for line in lines[:-1]:
            (choice,) = json.loads(line.removeprefix("data: "))["choices"]
            text = choice["delta"].get("content") if "delta" in choice else choice.get("text")
            if text:
                pieces.append(text)
            finish = choice["finish_reason"] or finish
        return pieces, finish

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout=10)


@pytest.fixture
def upstream():
    with FakeOpenAIServer(reply=lambda messages: f"fine, thanks {END_MARKER}",
                          complete=lambda prompt: f"bye {END_MARKER}") as server:
        yield server


def test_each_client_hears_its_own_end_marker_and_the_rest_passes_untouched(upstream):
    relay = Relay(upstream.base_url.removesuffix("/v1"), "--end-marker", "###STOP###")
    try:
        assert relay.banner.strip().endswith(f"{END_MARKER} -> ###STOP###")
        chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
        status, answer = relay.post("/chat/completions", chat)
        assert status == 200 and answer["choices"][0]["message"]["content"] == "fine, thanks ###STOP###"
        # a request names its own marker; the server never sees the field
        status, answer = relay.post("/chat/completions", {**chat, "end_marker": "[DONE]"})
        assert answer["choices"][0]["message"]["content"] == "fine, thanks [DONE]"
        assert "end_marker" not in upstream.requests[-1] and upstream.requests[-1]["messages"] == chat["messages"]
        status, answer = relay.post("/completions", {"model": "m", "prompt": [1, 2, 3]})
        assert status == 200 and answer["choices"][0]["text"] == "bye ###STOP###"
        assert upstream.requests[-1]["prompt"] == [1, 2, 3]
        # the agent-RL user model told to listen for ###STOP### hears the simulator end
        user = OpenAIUserModel(relay.base_url, "m", stop_marker="###STOP###", max_retries=0)
        (reply,) = user.reply_many(["You want a refund."], [[{"role": "assistant", "content": "Hello!"}]])
        assert reply.done and reply.utterance == "fine, thanks" and reply.error is None
        # a streamed request hears the same text, the marker rewritten though it arrives two characters at a time
        for path, body, text in (("/chat/completions", chat, "fine, thanks ###STOP###"),
                                 ("/completions", {"model": "m", "prompt": "x", "end_marker": "[DONE]"}, "bye [DONE]")):
            pieces, finish = relay.stream(path, body)
            assert "".join(pieces) == text and finish == "stop" and len(pieces) >= 3, pieces
            assert not any(set(piece) & set("<>") for piece in pieces)  # nothing of the trained marker leaks
        upstream.stream_piece = 100  # the whole marker in one event
        assert relay.stream("/chat/completions", chat)[0] == ["fine, thanks ###STOP###"]
        upstream.failures.append(503)
        status, answer = relay.post("/chat/completions", chat)
        assert status == 503 and answer["error"]["message"] == "scripted failure"
    finally:
        assert relay.stop() == 0  # SIGTERM ends it at once, with status 0
    # a server started with --api-key: the relay sends its key in place of the client's (gyms send Bearer EMPTY)
    upstream.api_key = "sim-key"
    assert relay_status(upstream, []) == 401
    assert relay_status(upstream, ["--api-key", "sim-key"]) == 200


def relay_status(upstream, args: list[str]) -> int:
    relay = Relay(upstream.base_url, *args)
    try:
        return relay.post("/chat/completions", {"model": "m", "messages": [{"role": "user", "content": "hi"}]})[0]
    finally:
        relay.stop()


def test_the_trained_marker_is_kept_by_default_and_a_dead_server_is_a_502_naming_it(upstream):
    relay = Relay(upstream.base_url)
    try:
        status, answer = relay.post("/chat/completions", {"model": "m", "messages": [{"role": "user", "content": "x"}]})
        assert status == 200 and answer["choices"][0]["message"]["content"] == f"fine, thanks {END_MARKER}"
    finally:
        relay.stop()
    dead = f"http://127.0.0.1:{_free_port()}"
    relay = Relay(dead)
    try:
        status, answer = relay.post("/chat/completions", {"model": "m", "messages": []})
        assert status == 502 and answer["error"]["message"].startswith(f"{dead}: ")
        relay.proc.kill()  # a hard kill leaves nothing behind: the relay has no children
        assert relay.proc.wait(timeout=10) == -signal.SIGKILL
    finally:
        if relay.proc.poll() is None:
            relay.stop()
    bad = subprocess.run([sys.executable, "-m", "megatron_mimesis.serving.marker_relay", "--upstream", dead,
                          "--end-marker", " "], cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
    assert bad.returncode == 1 and bad.stderr.strip() == "error: --end-marker must not be empty"
