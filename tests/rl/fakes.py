"""Test doubles for rollouts: a tokenizer whose ids can be written by hand, an engine that replays canned texts,
a counterpart that records what it was shown, and a tiny OpenAI-compatible HTTP server on 127.0.0.1.

Tokenizer ids: 0 <|endoftext|>, 1 <|im_start|>, 2 <|im_end|>, 3 <think>, 4 </think>, then one id per character
of ``CHARS`` from 5 on (BPE without merges encodes every character as its own token), so ``ids("hi")`` is exact.
"""

import json
import string
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from tokenizers import AddedToken, Tokenizer, decoders, models
from transformers import PreTrainedTokenizerFast

from megatron_mimesis.rl.simulator.counterparts import CounterpartReply
from megatron_mimesis.rl.types import Generation, SamplingParams

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>")
EOT, IM_START, IM_END, THINK, END_THINK = range(5)
CHARS = "\n " + string.ascii_letters + string.digits + "?.,!'<>|/_:" + '=#{}"()[]-*;'
VOCAB = {token: i for i, token in enumerate([*SPECIAL_TOKENS, *CHARS])}


def ids(text: str) -> list[int]:
    return [VOCAB[c] for c in text]


def char_tokenizer() -> PreTrainedTokenizerFast:
    tokenizer = Tokenizer(models.BPE(vocab=VOCAB, merges=[]))
    tokenizer.add_special_tokens([AddedToken(t, special=True) for t in SPECIAL_TOKENS])
    tokenizer.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer)


def logprob_of(k: int) -> float:
    """The log-prob ``FakeOpenAIServer`` reports for the k-th token of a completion."""
    return -(k + 1) / 4


def logprobs_for(n: int) -> list[float]:
    """The log-probs ``ScriptedEngine`` reports for a generation of ``n`` tokens."""
    return [-(j + 1) / 8 for j in range(n)]


class ScriptedEngine:
    """Replays ``texts[k]`` on the k-th ``generate`` call, which must bring exactly that many prompts.

    A generation's ids are its text encoded with special tokens (as a model would sample them) plus <|im_end|>; with
    ``finish_reason="length"`` every generation is one cut at the token limit instead (no <|im_end|>)."""

    def __init__(self, tokenizer, texts: list[list[str]], finish_reason: str = "stop"):
        self.tokenizer = tokenizer
        self.texts = texts
        self.finish_reason = finish_reason
        self.calls: list[tuple[list[list[int]], SamplingParams]] = []
        self.sleeps = 0
        self.wakes = 0

    def generate(self, prompts: list[list[int]], sampling: SamplingParams) -> list[Generation]:
        texts = self.texts[len(self.calls)]
        assert len(prompts) == len(texts), f"call {len(self.calls)}: {len(prompts)} prompts, {len(texts)} scripted"
        self.calls.append(([list(p) for p in prompts], sampling))
        generations = []
        for text in texts:
            token_ids = self.tokenizer.encode(text, add_special_tokens=False) + [IM_END] * (self.finish_reason == "stop")
            generations.append(Generation(token_ids, text, logprobs_for(len(token_ids)), self.finish_reason))
        return generations

    def sleep(self) -> None:
        self.sleeps += 1

    def wake(self) -> None:
        self.wakes += 1


class RecordingCounterpart:
    """Answers with ``fn(transcript) -> CounterpartReply`` and records every batch it was asked to answer."""

    def __init__(self, fn):
        self.fn = fn
        self.batches: list[list[list[dict]]] = []

    def reply_many(self, transcripts: list[list[dict]]) -> list[CounterpartReply]:
        self.batches.append(transcripts)
        return [self.fn(t) for t in transcripts]


class FakeOpenAIServer:
    """``POST /v1/chat/completions`` on an ephemeral port. It answers ``reply(messages)`` after first failing with
    the statuses in ``failures`` (one per request, with retry-after-ms: 1 so retries are quick), records every
    request body, and fails every request with 500 when ``broken``.

    ``POST /v1/completions`` answers ``complete(prompt)`` (the prompt as sent: token ids or text) the way
    ``vllm serve`` does. With ``encode`` (text -> the ids the model sampled) the server knows the ids: a
    completion ending in a requested ``stop_token_ids`` id stops there ("stop", ``stop_reason`` that id; else
    "length"), ``logprobs`` come back as ``logprob_of(k)`` for the k-th token, and the vLLM extensions named in
    ``id_fields`` are honoured (``return_token_ids``: ``token_ids``; ``return_tokens_as_token_ids``: logprob
    tokens ``"token_id:{id}"``; remove them to play an older or non-vLLM server). With ``refuse_echo`` it answers
    a request for prompt log-probs (``echo``) with 400, as a chat-model API does.

    ``GET /v1/models`` lists ``models`` (what a run's preflight asks); with ``api_key`` it answers every request
    without that bearer key with 401, as ``vllm serve --api-key`` does."""

    def __init__(self, reply=lambda messages: "ok " + messages[-1]["content"], complete=lambda prompt: "ok",
                 encode=None, refuse_echo=False, models=("sim",), api_key=None):
        self.reply = reply
        self.models, self.api_key = list(models), api_key
        self.refuse_echo = refuse_echo
        self.complete = complete
        self.encode = encode
        self.id_fields = {"return_token_ids", "return_tokens_as_token_ids"}
        self.stream_piece = 2  # characters per streamed event: a marker arrives in pieces
        self.requests: list[dict] = []
        self.failures: list[int] = []
        self.broken = False
        self.lock = threading.Lock()
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}/v1"

    def __enter__(self) -> "FakeOpenAIServer":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=5)

    def _answer(self, body: dict) -> tuple[int, dict]:
        with self.lock:
            self.requests.append(body)
            status = 500 if self.broken else (self.failures.pop(0) if self.failures else 200)
        if status != 200:
            return status, {"error": {"message": "scripted failure", "type": "server_error"}}
        content = self.reply(body["messages"])
        return 200, {
            "id": f"chatcmpl-{len(self.requests)}",
            "object": "chat.completion",
            "created": 0,
            "model": body["model"],
            "choices": [{"index": 0, "message": {"role": "assistant", "content": content}, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
        }

    def _completion(self, body: dict) -> tuple[int, dict]:
        with self.lock:
            self.requests.append(body)
            status = 500 if self.broken else (self.failures.pop(0) if self.failures else 200)
        if status != 200:
            return status, {"error": {"message": "scripted failure", "type": "server_error"}}
        if body.get("echo") and self.refuse_echo:
            return 400, {"error": {"message": "echo is not supported", "type": "invalid_request_error"}}
        text = self.complete(body["prompt"])
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": "stop", "stop_reason": None}
        if self.encode is not None:
            token_ids = self.encode(text)
            if token_ids and token_ids[-1] in body.get("stop_token_ids", []):
                choice["stop_reason"] = token_ids[-1]
            else:
                choice["finish_reason"] = "length"
            if body.get("return_token_ids") and "return_token_ids" in self.id_fields:
                choice["token_ids"] = token_ids
            if body.get("logprobs") is not None:
                as_ids = body.get("return_tokens_as_token_ids") and "return_tokens_as_token_ids" in self.id_fields
                tokens = [f"token_id:{t}" if as_ids else f"<{t}>" for t in token_ids]
                choice["logprobs"] = {"tokens": tokens, "token_logprobs": [logprob_of(k) for k in range(len(tokens))],
                                      "top_logprobs": [{t: logprob_of(k)} for k, t in enumerate(tokens)],
                                      "text_offset": list(range(len(tokens)))}
        return 200, {
            "id": f"cmpl-{len(self.requests)}",
            "object": "text_completion",
            "created": 0,
            "model": body["model"],
            "choices": [choice],
            "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
        }

    def _handler(self):
        fake = self
        routes = {"/v1/chat/completions": fake._answer, "/v1/completions": fake._completion}

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                if self.path != "/v1/models":
                    self._send(404, {})
                elif fake.api_key and self.headers.get("Authorization") != f"Bearer {fake.api_key}":
                    self._send(401, {"error": {"message": "invalid api key", "type": "invalid_request_error"}})
                else:
                    self._send(200, {"object": "list", "data": [{"id": m, "object": "model"} for m in fake.models]})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if fake.api_key and self.headers.get("Authorization") != f"Bearer {fake.api_key}":
                    return self._send(401, {"error": {"message": "invalid api key", "type": "invalid_request_error"}})
                status, payload = routes[self.path](body) if self.path in routes else (404, {})
                if body.get("stream") and status == 200:
                    return self._send_events(self.path, payload)
                self._send(status, payload)

            def _send_events(self, path, payload):
                """The answer as vLLM streams it: server-sent events of ``fake.stream_piece`` characters each, the
                finish_reason on an event of its own, then ``[DONE]``; the connection closes at the end."""
                choice = payload["choices"][0]
                chat = path.endswith("/chat/completions")
                text = choice["message"]["content"] if chat else choice["text"]
                pieces = [text[i:i + fake.stream_piece] for i in range(0, len(text), fake.stream_piece)]
                events = [{"delta": {"role": "assistant", "content": ""}}] if chat else []
                events += [{"delta": {"content": piece}} if chat else {"text": piece} for piece in pieces]
                events.append({"delta": {}, "finish_reason": choice["finish_reason"]} if chat
                              else {"text": "", "finish_reason": choice["finish_reason"]})
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream; charset=utf-8")
                self.end_headers()
                self.close_connection = True
                for event in events:
                    chunk = {"id": payload["id"], "object": payload["object"] + ".chunk", "created": 0,
                             "model": payload["model"], "choices": [{"index": 0, "finish_reason": None, **event}]}
                    self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
                self.wfile.write(b"data: [DONE]\n\n")

            def _send(self, status, payload):
                data = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.send_header("retry-after-ms", "1")
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):
                pass

        return Handler
