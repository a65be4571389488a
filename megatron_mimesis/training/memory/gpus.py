"""The GPUs a layout is planned for, and what a plan must leave free on them."""

# Memory the driver gives a process (torch.cuda.get_device_properties(0).total_memory, GiB), rounded down; a run on
# another card names its memory with gpu_memory_gib. The paper's layouts are A100-80GB nodes.
GPU_MEMORY_GIB = {"A100-80GB": 79.1, "H100-80GB": 79.1, "H200-141GB": 139.8}
DEFAULT_GPU = "A100-80GB"
# Part of the GPU a plan leaves unclaimed: the caching allocator's fragmentation and what no term models.
MARGIN = 0.05
