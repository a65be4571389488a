"""The memory plan of a stage config per GPU, with no other work: the table its ``--dry-run`` prints.

    mimesis-plan --config launch/configs/midtrain_9b.yaml [--nodes 4] [--gpus-per-node 8] [--json] [stage flags ...]

The config's ``stage`` picks the options (mid-training and SFT, simulator RL, agent RL), and any of that stage's
flags overrides the file (``--tensor-model-parallel-size 8``, ``--recompute-granularity full``, ``--gpu H100-80GB``,
``--gpu-memory-gib 94``). The job's size defaults to that of the stage's SLURM file beside the config
(``launch/slurm/<stage>.sbatch``: the paper's node layout), else one node of 8 GPUs. Only what a plan needs is
checked (model, layout, batch): no dataset, tokenizer or checkpoint has to exist. Exit 0 when every stage and phase
fits the GPU with the kept margin; 2, with the one-line reason (its biggest term and the cheapest change that fits),
when it does not or the config is invalid.

An RL config with ``engine: served`` (a split layout: ``--engine served``) is planned on both sides: the trainer's
GPUs (``--nodes`` of them, no engine) as above, then the rollout side's vLLM server (``rl/rollout_plan.py``) on
``--rollout-gpus`` GPUs as instances of ``--rollout-tensor-parallel``, at sequences of ``--rollout-max-model-len``.
"""

import argparse
import sys
from pathlib import Path

import yaml

from megatron_mimesis.pipeline import stages

RL_STAGES = ("rl_simulator", "rl_agent")


def sbatch_layout(config_path: str, stage: str) -> tuple[int, int] | None:
    """(nodes, GPUs per node) that ``launch/slurm/<stage>.sbatch`` asks SLURM for, found beside the config's folder."""
    return stages.sbatch_layout(Path(config_path).resolve().parent.parent / "slurm" / f"{stage}.sbatch")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="mimesis-plan", description=__doc__.split("\n\n")[0],
                                     epilog="Any flag of the config's stage follows, as for its --dry-run.")
    parser.add_argument("--config", required=True, help="a stage's YAML config (launch/configs/*.yaml)")
    parser.add_argument("--nodes", type=int, help="nodes of the job (default: the stage's sbatch file, else 1)")
    parser.add_argument("--gpus-per-node", type=int, help="GPUs per node (default: the stage's sbatch file, else 8)")
    parser.add_argument("--json", action="store_true", help="print the plan as JSON instead of the table")
    parser.add_argument("--rollout-gpus", type=int, default=8, help="engine=served: the rollout server's GPUs (8)")
    parser.add_argument("--rollout-tensor-parallel", type=int, default=1,
                        help="engine=served: the server's tensor parallel size per instance (1)")
    parser.add_argument("--rollout-max-model-len", type=int, default=32768,
                        help="engine=served: the longest sequence the server holds (32768)")
    parser.add_argument("--rollout-gpu-memory-utilization", type=float, default=0.9,
                        help="engine=served: vLLM's share of each GPU (0.9)")
    args, stage_flags = parser.parse_known_args(argv)

    from megatron_mimesis.compat import prepare_cpu_process

    prepare_cpu_process()
    from megatron_mimesis.training.config import ConfigError, parse_config
    from megatron_mimesis.training.memory.plan import plan_training, print_plan

    try:
        with open(args.config) as f:
            stage = (yaml.safe_load(f) or {}).get("stage", "midtrain")
        nodes, gpus_per_node = sbatch_layout(args.config, stage) or (1, 8)
        world_size = (args.nodes or nodes) * (args.gpus_per_node or gpus_per_node)
        config, _ = parse_config(["--config", args.config, *stage_flags], stages.config_class(stage), prog="mimesis-plan")
        config.validate_without_files(world_size)
        if stage in RL_STAGES:
            from megatron_mimesis.rl.memory import plan_rl

            plan, refusal = plan_rl(config, world_size)
        else:
            plan, refusal = plan_training(config, world_size)
    except (ConfigError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    server = None
    if stage in RL_STAGES and config.engine == "served":
        from megatron_mimesis.rl.rollout_plan import rollout_server_plan

        try:
            server = rollout_server_plan(config, args.rollout_gpus, args.rollout_tensor_parallel,
                                         args.rollout_max_model_len, args.rollout_gpu_memory_utilization)
        except ValueError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
    resolved = ({"rollout_plan": server.to_dict()} if server else {}) if args.json else None
    status = print_plan(plan, refusal, resolved=resolved, table=not args.json)
    if server is not None and not args.json:
        print()
        print(server.render())
    return status or (0 if server is None or server.fits else 2)

if __name__ == "__main__":
    sys.exit(main())
