"""``python mtp_drafter.py EXPORT OUT``: vLLM's Qwen3.5 MTP drafter built from an export (``speculative_config``
``{"method": "mtp"}``), its weights saved to OUT (safetensors) as the engine holds them. Run in vLLM's environment,
with the engine in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) so that the worker can be asked for them."""

import sys


def drafter_state(worker) -> dict:
    return {name: p.detach().clone().contiguous() for name, p in worker.model_runner.drafter.model.named_parameters()}


def keep_packed_weights() -> None:
    """vLLM's CPU backend empties a linear layer's weight once it has packed a copy for its GEMM kernel (oneDNN or
    sgl's, where the CPU has them: on this machine's AVX-512, not on older ones); kept, so that they can be read."""
    from vllm.model_executor.layers import utils

    dispatch = utils.dispatch_cpu_unquantized_gemm
    utils.dispatch_cpu_unquantized_gemm = lambda layer, remove_weight: dispatch(layer, remove_weight=False)


if __name__ == "__main__":
    from safetensors.torch import save_file
    from vllm import LLM

    from megatron_mimesis.rl.engines.vllm import CPU_TINY_OPTIONS

    export, out = sys.argv[1:]
    keep_packed_weights()
    llm = LLM(model=export, dtype="bfloat16", seed=0, speculative_config={"method": "mtp", "num_speculative_tokens": 1},
              **CPU_TINY_OPTIONS)
    (state,) = llm.collective_rpc(drafter_state)
    save_file(state, out)
