"""Fully parallel checkpoints with megatron's distributed optimizer over 2 data-parallel ranks: each rank writes its
own optimizer shard and half the weights, no rank holds the other's optimizer state while saving, each reads only
its share back, and a checkpoint reloads exactly at its own layout and at others (DP 2 -> 1, TP 1 -> 2)."""

import json
import math
import re
from collections import Counter
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from megatron_mimesis.checkpoint.reader import checkpoint_dir
from tests.multiproc import run_distributed

pytestmark = pytest.mark.slow

# The tiny preset widened so that an optimizer shard (12 bytes per parameter in fp32: weights, Adam's moments; 23M
# parameters) stands well above the allocator's noise in a rank's resident memory
WIDE = {"vocab_size": 8192, "hidden_size": 512, "ffn_hidden_size": 2048}
STATE_BYTES_PER_PARAMETER = 12


def _peak_rss_kib_reset() -> int:
    status = Path("/proc/self/status").read_text()
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM back to the current resident size
    return int(re.search(r"^VmRSS:\s+(\d+) kB", status, re.M)[1])


def _peak_rss_kib() -> int:
    return int(re.search(r"^VmHWM:\s+(\d+) kB", Path("/proc/self/status").read_text(), re.M)[1])


def _save(rank, world_size, root: str, layout: dict, load: str | None) -> dict:
    """A trainer at ``layout`` with a random Adam state (or the one of ``load``), saved synchronously to ``root`` as
    iteration 1: the rank's peak memory during the save above what it held before and the bytes of stored chunks it
    read to load, in bytes."""
    from megatron_mimesis.checkpoint import trainer_state
    from megatron_mimesis.compat import enable_cpu_compat
    from megatron_mimesis.models.presets import preset_record
    from megatron_mimesis.training.config import TrainConfig
    from megatron_mimesis.training.train import Trainer
    from tools.bench.bench_async_save import _random_adam_state

    enable_cpu_compat(announce=False)
    config = TrainConfig(model_overrides=WIDE, save=root, async_save=False, **layout)
    trainer = Trainer(config, tokenizer_dir=None)
    read = {}
    if load is None:
        _random_adam_state(trainer.optimizer, seed=rank)
    else:
        original = FileSystemReader.read_data

        def read_data(self, plan, planner):  # every stored chunk torch DCP reads for this rank
            read.update({(i.storage_index.fqn, i.storage_index.offset): self.storage_data[i.storage_index].length
                         for i in plan.items})
            return original(self, plan, planner)

        FileSystemReader.read_data = read_data
        trainer_state.load_checkpoint(load, trainer.model, trainer.optimizer, trainer.scheduler, config.preset)
        FileSystemReader.read_data = original
    run_config = {"preset": preset_record(config.preset), "padded_vocab_size": trainer.provider.padded_vocab_size,
                  "layout": trainer_state.current_layout()}
    before = _peak_rss_kib_reset()
    trainer.save_checkpoint({"iteration": 1, "consumed_samples": 0, "skipped_iters": 0}, run_config)
    return {"peak_above_start": (_peak_rss_kib() - before) * 1024, "read": sum(read.values()),
            "parameters": sum(p.numel() for chunk in trainer.model for p in chunk.parameters())}


def _bytes_by_rank(directory: Path) -> tuple[Counter, Counter]:
    """Tensor bytes in each rank's files (torch DCP's ``__{rank}_{n}.distcp``), all and the optimizer state's: each
    stored chunk's elements, by the file ``.metadata`` says holds it."""
    metadata = FileSystemReader(str(directory)).read_metadata()
    written, optimizer = Counter(), Counter()
    for index, info in metadata.storage_data.items():
        tensor = metadata.state_dict_metadata[index.fqn]
        if not hasattr(tensor, "chunks"):
            continue  # an object (RNG states, the common state)
        (chunk,) = [c for c in tensor.chunks if c.offsets == index.offset]
        size = math.prod(chunk.sizes) * tensor.properties.dtype.itemsize
        rank = int(re.match(r"__(\d+)_", info.relative_path)[1])
        written[rank] += size
        optimizer[rank] += size if index.fqn.startswith("optimizer.") else 0
    return written, optimizer


def _tensors(directory: Path, out: Path) -> dict[str, torch.Tensor]:
    dcp_to_torch_save(str(directory), str(out))
    return {k: v for k, v in torch.load(out, weights_only=False).items() if isinstance(v, torch.Tensor)}


def test_each_rank_writes_its_share_holds_only_its_state_and_the_checkpoint_reshards_exactly(tmp_path):
    source = tmp_path / "dp2"
    (rank0, rank1) = run_distributed(_save, 2, str(source), {}, None)
    saved = checkpoint_dir(source, 1)
    written, optimizer = _bytes_by_rank(saved)
    # the whole optimizer state, from the model's size: the fp32 weights and Adam's two moments of every parameter
    state_bytes = STATE_BYTES_PER_PARAMETER * rank0["parameters"]
    assert sum(optimizer.values()) == state_bytes
    for rank in (0, 1):  # each rank writes its own half of it and about half of the weights
        assert 0.45 * state_bytes < optimizer[rank] < 0.55 * state_bytes, optimizer
        assert 0.4 < written[rank] / sum(written.values()) < 0.6, written
    for rank in (rank0, rank1):  # megatron's fully_reshardable all-gathered the whole state on each rank (2.4x)
        assert rank["peak_above_start"] < 0.5 * state_bytes, (rank["peak_above_start"], state_bytes)

    # a reload writes back exactly what it read: at the same layout, with one data-parallel rank, at TP=2
    reference = _tensors(saved, tmp_path / "dp2.pt")
    assert sum(k.startswith("optimizer.state.exp_avg_sq.") for k in reference) > 20
    stored = sum(info.length for info in FileSystemReader(str(saved)).read_metadata().storage_data.values())
    for name, world_size, layout in (("same", 2, {}), ("dp1", 1, {}), ("tp2", 2, {"tensor_model_parallel_size": 2})):
        ranks = run_distributed(_save, world_size, str(tmp_path / name), layout, str(source))
        # at its own layout each rank reads its share (megatron's fully_reshardable load read the whole TP shard's
        # state on every rank); at TP=2, each reads every stored box its half of a column-split weight overlaps
        if name == "same":
            assert all(r["read"] < 0.6 * stored for r in ranks), (ranks, stored)
        assert sum(r["read"] for r in ranks) > 0.99 * stored, (name, ranks, stored)  # all but another layout's RNG
        again = _tensors(checkpoint_dir(tmp_path / name, 1), tmp_path / f"{name}.pt")
        assert again.keys() == reference.keys(), name
        differing = [k for k in reference if not torch.equal(reference[k], again[k])]
        assert not differing, (name, differing)


def _former_format_round_trip(rank, world_size, root: str) -> bool:
    """A checkpoint saved ``fully_reshardable`` (this project's format before), loaded back by ``load_checkpoint``:
    whether every optimizer state tensor of the rank is the one saved."""
    import torch.distributed as dist

    from megatron_mimesis.checkpoint import trainer_state
    from megatron_mimesis.checkpoint.writer import save_request
    from megatron_mimesis.compat import enable_cpu_compat
    from megatron_mimesis.models.presets import preset_record
    from megatron_mimesis.training.config import TrainConfig
    from megatron_mimesis.training.train import Trainer
    from tools.bench.bench_async_save import _random_adam_state, former_state

    enable_cpu_compat(announce=False)
    config = TrainConfig(model_overrides={"vocab_size": 512})
    trainer = Trainer(config, tokenizer_dir=None)
    _random_adam_state(trainer.optimizer, seed=rank)
    states = [state for inner in trainer_state._inner_torch_optimizers(trainer.optimizer)
              for state in inner.state.values()]
    saved = [{k: v.clone() for k, v in state.items()} for state in states]
    directory = checkpoint_dir(root, 1)
    if rank == 0:
        directory.mkdir(parents=True)
    dist.barrier()
    save_request(former_state(trainer), directory, forked=False).execute_sync()
    if rank == 0:
        (directory / "run_config.json").write_text(json.dumps({
            "preset": preset_record(config.preset), "padded_vocab_size": trainer.provider.padded_vocab_size,
            "layout": trainer_state.current_layout()}))
        (Path(root) / "latest").write_text("1\n")
    dist.barrier()
    for state in states:
        for name in ("exp_avg", "exp_avg_sq"):
            state[name].zero_()
    trainer_state.load_checkpoint(root, trainer.model, trainer.optimizer, trainer.scheduler, config.preset)
    return all(torch.equal(state[k], before[k]) for state, before in zip(states, saved, strict=True) for k in before)


def test_a_checkpoint_of_the_former_format_loads_into_each_ranks_shard(tmp_path):
    assert run_distributed(_former_format_round_trip, 2, str(tmp_path)) == [True, True]
