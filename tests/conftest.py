import os

# Triton kernels run on the CPU through the interpreter; set before anything imports triton.
os.environ.setdefault("TRITON_INTERPRET", "1")
# torch.compile'd pieces of megatron-core (e.g. the gated norm) compile once per test session, not per test.
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(os.path.dirname(__file__), "..", ".cache", "inductor"))
