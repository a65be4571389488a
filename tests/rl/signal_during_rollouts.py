"""An RL entry point (``python -m tests.rl.signal_during_rollouts FLAGS simulator|agent FLAGS``, under torchrun,
one process) that sends SIGTERM to its torchrun once the rollouts of iteration 2 have generated their first batch: the
signal comes back to the rank through torchrun's forwarding, in the middle of a step, as SLURM's would."""

import os
import signal
import sys
import time

from megatron_mimesis.rl.loop import STEPS_PER_SEED

FORWARDED_WITHIN_S = 3.0  # torchrun passes the signal on at once; the rank checks after its next batch


def _signal_once_in_step_2(run):
    def run_and_signal(self, *args, stop_requested, **kwargs):
        step_seed = kwargs["step_seed"]
        sent = []

        def stop_requested_after_signal():
            if step_seed % STEPS_PER_SEED == 1 and not sent:  # one rank: the step seed's step is iteration 2's
                sent.append(os.kill(os.getppid(), signal.SIGTERM))
                time.sleep(FORWARDED_WITHIN_S)
            return stop_requested()

        return run(self, *args, stop_requested=stop_requested_after_signal, **kwargs)

    return run_and_signal


if __name__ == "__main__":
    stage = next(arg for arg in sys.argv[1:] if arg in ("simulator", "agent"))
    argv = [arg for arg in sys.argv[1:] if arg != stage]
    if stage == "simulator":
        from megatron_mimesis.rl import simulator_rl as module
        from megatron_mimesis.rl.simulator.episodes import EpisodeRunner as Runner
    else:
        from megatron_mimesis.rl import agent_rl as module
        from megatron_mimesis.rl.agent.episodes import AgentEpisodeRunner as Runner
    Runner.run = _signal_once_in_step_2(Runner.run)
    sys.exit(module.main(argv))
