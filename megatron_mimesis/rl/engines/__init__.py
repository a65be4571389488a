"""Rollout engines: what samples the policy's tokens. The protocol every engine provides (``protocol.py``), the
four engines (``local``: the training model itself; ``vllm``: vLLM colocated in the training processes; ``hf``:
transformers; ``openai``: a completions endpoint), how the RL stages pick one and keep it in step with the
trainer (``factory.py``, ``weight_sync.py``), and the limit on a hung call (``generation_timeout.py``)."""
