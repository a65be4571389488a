"""A preemption in the middle of an RL step (an agent-RL step outlasts SLURM's pre-timeout warning): the signal,
sent to torchrun during iteration 2's rollouts, makes every rank drop the step at the next check and save iteration
1 at once; the requeued run redoes iteration 2 exactly as the uninterrupted run did."""

import json
import os
import signal
from types import SimpleNamespace

import pytest
import torch.distributed as dist

from megatron_mimesis.rl.loop import RLLoop, StepAbandoned
from megatron_mimesis.training.signals import ExitSignal
from tests.multiproc import run_distributed
from tests.rl.test_agent_rl import AGENT_RL, _agent_args
from tests.rl.test_simulator_rl import _rl_args
from tests.training.conftest import read_metrics, run_trainer, run_under_torchrun

pytestmark = pytest.mark.slow

STAGES = {"simulator": ("megatron_mimesis.rl.simulator_rl", ("reward_mean", "pg_loss", "rows", "grad_norm")),
          "agent": (AGENT_RL, ("reward_mean", "pg_loss", "rows", "grad_norm", "csd_gate_mean"))}


def _args(stage, tiny_dataset, tiny_hf_checkpoint, tmp_path, log, *extra):
    if stage == "simulator":
        args = _rl_args(tiny_dataset, tiny_hf_checkpoint, tmp_path, "--prompts-per-step", "2",
                        "--rollouts-per-prompt", "2", "--max-new-tokens", "6")
        args[args.index("--log-dir") + 1] = str(tmp_path / log)
    else:
        args = _agent_args(tiny_dataset, tiny_hf_checkpoint, tmp_path / log, "--tasks-per-step", "1",
                           "--rollouts-per-prompt", "2", "--max-new-tokens", "6", "--csd-alpha", "0.5")
    return [*args, "--train-iters", "3", *extra]


@pytest.mark.parametrize("stage", list(STAGES))
def test_a_signal_mid_step_saves_the_last_complete_step_and_the_requeue_redoes_the_step(
        stage, tiny_dataset, tiny_hf_checkpoint, tmp_path):
    module, compared = STAGES[stage]
    run_trainer(1, *_args(stage, tiny_dataset, tiny_hf_checkpoint, tmp_path, "uninterrupted"), module=module)
    uninterrupted = {r["iteration"]: r for r in read_metrics(tmp_path / "uninterrupted")}
    save = ["--save", str(tmp_path / "ckpt"), "--save-interval", "10"]  # no periodic save: the stop must save
    preempted = run_under_torchrun(1, stage, *_args(stage, tiny_dataset, tiny_hf_checkpoint, tmp_path, "run", *save),
                                   module="tests.rl.signal_during_rollouts", check=False)
    out = preempted.stdout + preempted.stderr
    assert ("exit signal received during iteration 2 (after its rollouts): stopping at iteration 1, the last "
            "complete step, saving it, for requeue") in out, out[-4000:]
    assert (tmp_path / "ckpt" / "latest").read_text().strip() == "1"
    assert [r["iteration"] for r in read_metrics(tmp_path / "run")] == [1]
    assert json.loads((tmp_path / "run" / "exit.json").read_text()) == {
        "stopped": "signal", "signal": "SIGTERM", "iteration": 1, "saved": True}
    run_trainer(1, *_args(stage, tiny_dataset, tiny_hf_checkpoint, tmp_path, "run", *save), module=module)
    resumed = {r["iteration"]: r for r in read_metrics(tmp_path / "run")}
    assert sorted(resumed) == [1, 2, 3]
    for it in (2, 3):
        assert {k: resumed[it].get(k) for k in compared} == {k: uninterrupted[it].get(k) for k in compared}, it


def _one_replica_signalled(rank, world_size):
    """Two data-parallel replicas of one rank each; the signal reaches replica 1 only."""
    groups = [dist.new_group([r]) for r in range(world_size)]
    loop = SimpleNamespace(exit_signal=ExitSignal(), mp_group=groups[rank], dp_size=world_size, dp_group=None,
                           device="cpu", _phase_ended=lambda: None)
    if rank == 1:
        os.kill(os.getpid(), signal.SIGUSR1)
    own_rollouts_stop = RLLoop.rollouts_must_stop(loop)
    try:
        RLLoop.stop_point(loop, "scoring")
        phase = None
    except StepAbandoned as abandoned:
        phase = abandoned.phase
    return own_rollouts_stop, phase, RLLoop.replica_spread(loop, [3.0, 5.5][rank])


def test_a_signal_on_one_replica_ends_its_rollouts_and_drops_the_step_on_every_rank():
    """The signalled replica stops generating (its own group agrees), the other goes on to the next stop point, where
    every rank drops the step together; the rollout times of both replicas reach both."""
    (stop0, phase0, spread0), (stop1, phase1, spread1) = run_distributed(_one_replica_signalled, 2)
    assert (stop0, stop1) == (False, True)
    assert phase0 == phase1 == "scoring"
    assert spread0 == spread1 == {"rollout_time_max_s": 5.5, "rollout_time_spread_s": 2.5}
