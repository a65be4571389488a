"""Pack variable-length samples into fixed-length rows (best-fit decreasing).

Best-fit decreasing leaves little padding (typically well under 1% for conversation-sized samples) and is
deterministic: samples are placed longest first, ties broken by sample index, each into the fullest row that
still has room. Rows keep their samples as separate documents; the trainer turns the boundaries into
cu_seqlens so neither attention nor the Gated DeltaNet state crosses them.
"""

from bisect import bisect_left, insort


def pack(lengths: list[int], row_length: int) -> list[list[int]]:
    """Return rows as lists of sample indices; every sample must be at most ``row_length`` long."""
    rows: list[list[int]] = []
    free: list[tuple[int, int]] = []  # (room left, row index), sorted
    for index in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        length = lengths[index]
        if length > row_length:
            raise ValueError(f"sample {index} has {length} tokens, more than the row length {row_length}")
        slot = bisect_left(free, (length, -1))
        if slot < len(free):
            room, row = free.pop(slot)
        else:
            room, row = row_length, len(rows)
            rows.append([])
        rows[row].append(index)
        if room - length > 0:
            insort(free, (room - length, row))
    return rows
