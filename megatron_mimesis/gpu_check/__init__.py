"""One GPU acceptance run, prepared to run right the first time on a single A100 / H100 / H200, in under 10 minutes.

    python -m megatron_mimesis.gpu_check [--out DIR] [--stages kernels parity throughput agent vllm]

Stages, each in its own process with its own time cap (a crash, an OOM or a hang costs that stage only), the report
(``DIR/gpu_check.json`` and ``DIR/gpu_check.md``) rewritten after every stage, and each stage writing its rows as
it goes, so a stage stopped at its cap still reports what it measured:

- kernels: the GRPO policy loss from hidden states at N=16384 tokens (4 sequences of 4096), V=248320, H=4096 and
  H=2048, bf16: forward+backward time and peak memory of ours, Liger's ``triton_grpo_loss`` and
  ``LigerFusedLinearGRPOLoss``, torch eager and torch.compile (``kernels/bench.py``'s providers), each as a ratio
  to ours and to the three bare cuBLAS lm-head GEMMs measured in the same run, with errors against fp32.
- parity: the compiled Triton kernels against the plain-PyTorch references (padded and unpadded vocab), fla's
  Gated DeltaNet against the CPU fallback on packed THD rows of several documents (outputs and gradients), and the
  Transformer Engine layer spec against the local spec on the same weights (logits, loss, gradients, bf16), for each
  family's tiny preset.
- throughput: 4 Qwen3.5-9B-width layers (3 Gated DeltaNet + 1 attention) plus the 248320-row lm head and the fused
  loss at sequence length 24576, micro-batch 1, bf16, Transformer Engine + fla on this one GPU, built and wrapped in
  DDP as the trainer does: tokens/s, TFLOP/s and MFU by ``training/flops.py``, peak memory; the memory plan of the
  same step against it (each layer's saved tensors, and ``max_memory_allocated`` within 10% of the plan); the
  extrapolation to 32 layers at TP=4 with its assumptions spelled out; and one 32768-token micro-batch of the
  agent-RL update (GRPO + CSD, rollout-corrected) on the same layers against the agent-RL plan's update column.
- agent: the agent's family, Qwen3-8B: 4 layers at its width and its 151936-row head take one 32768-token
  micro-batch of the agent-RL update, timed, with each layer's saved tensors and the step's peak against the agent-RL
  plan of the same model (the plan Qwen3-8B's layout rests on).
- vllm (where vLLM is installed): a megatron trainer and the colocated vLLM engine in one process, as the RL stages
  run them, for each family's tiny preset (the simulator's Qwen3.5, the agent's Qwen3): the engine's start and
  weight-sync times, its log-probs after the sync against the trainer's (and, as
  the control, before it), and that sleep frees its memory (``torch.cuda.mem_get_info`` before and after) while
  wake gives back the same log-probs. The same stage runs on the CPU backend in the vLLM tests.

Without a GPU it prints one line and exits 2. Exit 1 when any stage did not finish ok. The orchestration is
``run.py``; each stage is a module of its own (``kernels``, ``parity``, ``throughput`` with ``agent``, ``vllm``).
"""

