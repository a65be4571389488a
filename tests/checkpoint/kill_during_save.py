"""A trainer (tiny model, a world of one) that saves iteration 1, changes its weights, and is SIGKILLed by itself
at one phase of saving iteration 2: ``python -m tests.checkpoint.kill_during_save PHASE SAVE_ROOT``.

Before dying it writes ``SAVE_ROOT/../writer.pid`` (the forked writer's pid, when one is running; in the first phase
it is made to stall, so it is alive when the rank dies) so that the test can check the writer died with it. Phases (``PHASES``): the forked writer still writing; its write done, nothing
finalized; megatron's finalization done (``.metadata``), ours not; listed in ``files.json``, not yet renamed; and
the synchronous save's write done, before its ``.metadata``.
"""

import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_mimesis.checkpoint import trainer_state
from megatron_mimesis.compat import enable_cpu_compat
from megatron_mimesis.models.presets import preset_record
from megatron_mimesis.training.config import TrainConfig
from tests.training.conftest import VOCAB

PHASES = ("async-writing", "async-written", "metadata-written", "listed", "sync-written")
MARKED = "decoder.final_layernorm.weight"  # 0 in the checkpoint of iteration 1, 1 in that of iteration 2


def _die(root: Path, calls=None) -> None:
    writer = calls.async_calls[0].async_caller.process if calls is not None and calls.async_calls else None
    (root.parent / "writer.pid").write_text(str(writer.pid) if writer is not None else "")
    os.kill(os.getpid(), signal.SIGKILL)


def _arm(phase: str, root: Path) -> None:
    from megatron.core.dist_checkpointing.strategies import async_utils, state_dict_saver

    if phase == "async-writing":
        from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

        write = FileSystemWriterAsync.write_preloaded_data_multithread  # the writer stalls for minutes first
        FileSystemWriterAsync.write_preloaded_data_multithread = staticmethod(
            lambda *args: (time.sleep(600), write(*args)))
        schedule = async_utils.AsyncCallsQueue.schedule_async_request

        def schedule_then_die(self, request):
            schedule(self, request)
            _die(root, self)

        async_utils.AsyncCallsQueue.schedule_async_request = schedule_then_die
    elif phase == "async-written":
        def die_before_finalizing(self, blocking=False, no_dist=False):
            self.async_calls[0].async_caller.process.join()
            _die(root)

        async_utils.AsyncCallsQueue.maybe_finalize_async_calls = die_before_finalizing
    elif phase == "metadata-written":
        trainer_state.CheckpointSaver._publish = lambda *args: _die(root)
    elif phase == "listed":
        trainer_state.publish = lambda *args: _die(root)
    elif phase == "sync-written":
        state_dict_saver.save_state_dict_async_finalize = lambda *args: _die(root)


def main(phase: str, root: str) -> None:
    from megatron_mimesis.training.train import Trainer

    root = Path(root)
    enable_cpu_compat()
    dist.init_process_group("gloo", init_method=f"file://{root.parent / 'rendezvous'}", rank=0, world_size=1)
    config = TrainConfig(model_overrides={"vocab_size": VOCAB}, save=str(root), async_save=phase != "sync-written")
    trainer = Trainer(config, tokenizer_dir=None)
    trainer_state._prepare_adam_for_load(trainer.optimizer)  # an Adam state to save without training a step
    weight = dict(trainer.model[0].module.named_parameters())[MARKED]
    progress = {"iteration": 1, "consumed_samples": 0, "skipped_iters": 0}
    run_config = {"preset": preset_record(config.preset), "padded_vocab_size": trainer.provider.padded_vocab_size}
    with torch.no_grad():
        weight.fill_(0.0)
    trainer.save_checkpoint(progress, run_config)
    trainer.wait_for_checkpoint()
    with torch.no_grad():
        weight.fill_(1.0)
    _arm(phase, root)
    trainer.save_checkpoint({**progress, "iteration": 2}, run_config)
    trainer.wait_for_checkpoint()
    raise AssertionError(f"{phase}: the save of iteration 2 finished instead of being killed")


if __name__ == "__main__":
    main(*sys.argv[1:])
