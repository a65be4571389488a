"""An RL entry point with a fault at a fixed point of a run with a rollout worker, under torchrun:

    python -m tests.rl.worker_faults FLAGS fail|signal simulator|agent FLAGS

``fail``: the episode runner raises during iteration 2's rollouts (on the worker's thread). ``signal``: SIGTERM goes to
torchrun as the trainer starts iteration 2's update, and comes back to every rank through torchrun's forwarding
while the worker plays iteration 3 a version ahead: the trainer's next stop point drops iteration 2, whatever the
timing, and the worker's rollouts stop at their next check."""

import os
import signal
import sys
import time

from megatron_mimesis.rl.loop import STEPS_PER_SEED, RLLoop

MESSAGE = "injected rollout failure"
FORWARDED_WITHIN_S = 10.0


def _fail_in_step_2(run):
    def run_or_fail(self, *args, **kwargs):
        if kwargs["step_seed"] % STEPS_PER_SEED == 1:  # the step seed's step is iteration 2's
            raise RuntimeError(MESSAGE)
        return run(self, *args, **kwargs)

    return run_or_fail


def _signal_in_update_2(train):
    def signal_then_train(self, step, rollouts):
        if step == 1:
            os.kill(os.getppid(), signal.SIGTERM)
            deadline = time.monotonic() + FORWARDED_WITHIN_S
            while self.exit_signal.received is None and time.monotonic() < deadline:
                time.sleep(0.05)
        return train(self, step, rollouts)

    return signal_then_train


if __name__ == "__main__":
    fault = next(arg for arg in sys.argv[1:] if arg in ("fail", "signal"))
    stage = next(arg for arg in sys.argv[1:] if arg in ("simulator", "agent"))
    argv = [arg for arg in sys.argv[1:] if arg not in (fault, stage)]
    if stage == "simulator":
        from megatron_mimesis.rl import simulator_rl as module
        from megatron_mimesis.rl.simulator.episodes import EpisodeRunner as Runner
        loop = module.SimulatorRL
    else:
        from megatron_mimesis.rl import agent_rl as module
        from megatron_mimesis.rl.agent.episodes import AgentEpisodeRunner as Runner
        loop = module.AgentRL
    if fault == "fail":
        Runner.run = _fail_in_step_2(Runner.run)
    else:
        loop.train = _signal_in_update_2(loop.train)
    assert issubclass(loop, RLLoop)
    sys.exit(module.main(argv))
