"""Triton kernels behind group_stats.py: one program per possible segment walks its rows in sorted order."""

import triton
import triton.language as tl


@triton.jit
def group_advantage_kernel(REWARD, FIRST, ORDER, STARTS, OUT, num_rows, eps, UNBIASED: tl.constexpr,
                            ZERO_POSITIVE_FOR_NEGATIVE: tl.constexpr, BLOCK: tl.constexpr):
    start = tl.load(STARTS + tl.program_id(0))
    end = tl.load(STARTS + tl.program_id(0) + 1)
    if start >= num_rows:
        return
    total = tl.zeros((BLOCK,), tl.float32)
    count = tl.zeros((BLOCK,), tl.float32)
    for offset in range(start, end, BLOCK):
        rows = offset + tl.arange(0, BLOCK)
        first = tl.load(FIRST + rows, mask=rows < end, other=0).to(tl.float32)
        total += first * tl.load(REWARD + rows, mask=rows < end, other=0.0)
        count += first
    n = tl.sum(count, axis=0)
    mean = tl.sum(total, axis=0) / n
    squares = tl.zeros((BLOCK,), tl.float32)
    for offset in range(start, end, BLOCK):
        rows = offset + tl.arange(0, BLOCK)
        first = tl.load(FIRST + rows, mask=rows < end, other=0).to(tl.float32)
        deviation = tl.load(REWARD + rows, mask=rows < end, other=0.0) - mean
        squares += first * deviation * deviation
    if UNBIASED:
        std = tl.sqrt(tl.sum(squares, axis=0) / tl.maximum(n - 1.0, 1.0))
    else:
        std = tl.sqrt(tl.sum(squares, axis=0) / n)
    single = n < 2.0
    mean = tl.where(single, 0.0, mean)
    std = tl.where(single, 1.0, std)
    flat = std <= eps
    for offset in range(start, end, BLOCK):
        rows = offset + tl.arange(0, BLOCK)
        reward = tl.load(REWARD + rows, mask=rows < end, other=0.0)
        advantage = tl.where(flat, 0.0, (reward - mean) / (std + eps))
        if ZERO_POSITIVE_FOR_NEGATIVE:
            advantage = tl.where((reward < 0.0) & (advantage > 0.0), 0.0, advantage)
        tl.store(OUT + tl.load(ORDER + rows, mask=rows < end, other=0), advantage, mask=rows < end)


@triton.jit
def discounted_returns_kernel(REWARD, ORDER, STARTS, OUT, num_rows, gamma):
    start = tl.load(STARTS + tl.program_id(0))
    end = tl.load(STARTS + tl.program_id(0) + 1)
    if start >= num_rows:
        return
    running = 0.0
    for step in range(0, end - start):
        row = end - 1 - step
        running = tl.load(REWARD + row) + gamma * running
        tl.store(OUT + tl.load(ORDER + row), running)
