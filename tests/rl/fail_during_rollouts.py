"""An RL entry point (``python -m tests.rl.fail_during_rollouts FLAGS simulator|agent FLAGS``) whose episode runner
raises during iteration 2's rollouts: an error mid-run, on whichever thread plays the rollouts."""

import sys

from megatron_mimesis.rl.loop import STEPS_PER_SEED

MESSAGE = "injected rollout failure"


def _fail_in_step_2(run):
    def run_or_fail(self, *args, **kwargs):
        if kwargs["step_seed"] % STEPS_PER_SEED == 1:  # the step seed's step is iteration 2's
            raise RuntimeError(MESSAGE)
        return run(self, *args, **kwargs)

    return run_or_fail


if __name__ == "__main__":
    stage = next(arg for arg in sys.argv[1:] if arg in ("simulator", "agent"))
    argv = [arg for arg in sys.argv[1:] if arg != stage]
    if stage == "simulator":
        from megatron_mimesis.rl import simulator_rl as module
        from megatron_mimesis.rl.simulator.episodes import EpisodeRunner as Runner
    else:
        from megatron_mimesis.rl import agent_rl as module
        from megatron_mimesis.rl.agent.episodes import AgentEpisodeRunner as Runner
    Runner.run = _fail_in_step_2(Runner.run)
    sys.exit(module.main(argv))
