"""An ``openai:`` simulator's likelihood from prompt log-probs equals the in-process model's.

No vLLM runs in this environment, so the server is a small ``/v1/completions`` endpoint over the same tiny HF
model: with ``echo`` it returns each prompt token's log-prob as vLLM does (the first one null), and can be told to
refuse prompt log-probs as a server without them does.
"""

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.eval.test_cli import eval_simulator


class EchoLogprobServer:
    def __init__(self, model, tokenizer, refuse_echo: bool = False):
        self.model, self.tokenizer, self.refuse_echo = model, tokenizer, refuse_echo
        self.lock = threading.Lock()
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}/v1"

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()

    @torch.no_grad()
    def complete(self, body: dict) -> tuple[int, dict]:
        prompt = body["prompt"]
        if body.get("echo") and self.refuse_echo:
            return 400, {"error": {"message": "echo is not supported", "type": "invalid_request_error"}}
        choice = {"index": 0, "text": "hi", "token_ids": self.tokenizer.encode("hi") + [body["stop_token_ids"][0]]
                  if body.get("stop_token_ids") else [], "finish_reason": "stop", "logprobs": None}
        if body.get("echo"):
            with self.lock:
                logits = self.model(input_ids=torch.tensor([prompt])).logits[0].float()
            logprobs = torch.log_softmax(logits, dim=-1)
            values = [None] + [float(logprobs[t - 1, prompt[t]]) for t in range(1, len(prompt))] + [-1.0]
            choice["logprobs"] = {"tokens": [f"token_id:{t}" for t in prompt] + ["x"], "token_logprobs": values,
                                  "top_logprobs": None, "text_offset": list(range(len(values)))}
            choice["text"] = ""
        return 200, {"id": "cmpl", "object": "text_completion", "created": 0, "model": body["model"],
                     "choices": [choice], "usage": {"prompt_tokens": len(prompt), "completion_tokens": 1,
                                                    "total_tokens": len(prompt) + 1}}

    def _handler(self):
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                status, payload = fake.complete(body) if self.path == "/v1/completions" else (404, {})
                data = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):
                pass

        return Handler


@pytest.fixture(scope="module")
def served(tiny_hf_checkpoint, tiny_dataset):
    model = AutoModelForCausalLM.from_pretrained(tiny_hf_checkpoint, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(tiny_dataset / "tokenizer")


def test_prompt_logprobs_give_the_in_process_nll(served, tiny_hf_checkpoint, tiny_dataset, heldout_file, tmp_path):
    with EchoLogprobServer(*served) as server, EchoLogprobServer(*served, refuse_echo=True) as refusing:
        code = eval_simulator.main([
            "--simulator", f"local=hf:{tiny_hf_checkpoint}", "--simulator", f"served=openai:{server.base_url}@tiny",
            "--simulator", f"no-echo=openai:{refusing.base_url}@tiny", "--tokenizer", str(tiny_dataset / "tokenizer"),
            "--input", str(heldout_file), "--seq-length", "128", "--max-new-tokens", "2", "--bootstrap", "0",
            "--output", str(tmp_path / "out"), "--no-progress"])
    assert code == 0
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    local, remote = results["cells"]["local"], results["cells"]["served"]
    assert remote["nll_per_token"]["value"] == pytest.approx(local["nll_per_token"]["value"], rel=1e-5)
    assert remote["bits_per_byte"]["value"] == pytest.approx(local["bits_per_byte"]["value"], rel=1e-5)
    assert results["counts"]["served"]["likelihood_tokens"] == results["counts"]["local"]["likelihood_tokens"] > 0
    assert results["cells"]["no-echo"]["nll_per_token"]["value"] is None
    assert "refuses prompt log-probs" in results["counts"]["no-echo"]["likelihood_note"]
    assert results["counts"]["served"]["observations"] == 7  # the served simulator's replies ("hi") were scored
