"""The smallest real dist checkpoint: what ``--load`` validation reads (its ``.metadata`` is parsed and
verified), without building a model."""

from pathlib import Path


def small_checkpoint(root: Path, iteration: int) -> Path:
    """A save root whose ``latest`` names a real one-tensor dist checkpoint at ``iteration``."""
    import torch
    import torch.distributed.checkpoint as dcp

    path = root / f"iter_{iteration:07d}"
    dcp.save({"w": torch.zeros(1)}, checkpoint_id=str(path), no_dist=True)
    (root / "latest").write_text(str(iteration))
    return path
