"""``python -m megatron_mimesis.pipeline`` (``bash launch/pipeline.sh``, ``make pipeline``): the MIMESIS loop.

    run    [DEFINITION] [--run-dir DIR] [--given STAGE=PATH ...] [--check]   every stage here, in order
    submit [DEFINITION] [--run-dir DIR] [--given STAGE=PATH ...] [--dry-run] the stages as dependent SLURM jobs
    status [DEFINITION] [--run-dir DIR]                                      a submitted chain: jobs, records, logs
    stage  DEFINITION STAGE [--run-dir DIR] [--given ...]                    one stage (what each SLURM job runs)

DEFINITION defaults to launch/pipelines/demo.yaml (the tiny presets on CPU); launch/pipelines/paper.yaml is the
paper's chain. Every hand-off is resolved and checked first, and a wrong one exits 2 with one line, before anything
runs. A second run skips the stages that are done and resumes the one that was interrupted.
"""

import argparse
import os
import sys
from pathlib import Path

DEFAULT = Path(__file__).resolve().parents[2] / "launch" / "pipelines" / "demo.yaml"


def _given(values: list[str]) -> dict[str, str]:
    given = {}
    for value in values:
        name, sep, path = value.partition("=")
        if not sep or not name or not path:
            raise SystemExit(f"error: --given {value!r}: expected STAGE=PATH (or STAGE=URL@MODEL for a server)")
        given[name] = path
    return given


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m megatron_mimesis.pipeline", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n\n", 1)[1])
    sub = parser.add_subparsers(dest="command", required=True)
    commands = {}
    for name, what in (("run", "run every stage here"), ("submit", "submit the stages as dependent SLURM jobs"),
                       ("status", "a submitted chain: each stage's job, its state on the cluster, its record and log"),
                       ("stage", "run one stage (a SLURM job of the chain)")):
        commands[name] = p = sub.add_parser(name, help=what)
        p.add_argument("definition", nargs="?" if name != "stage" else None, type=Path, default=DEFAULT)
        if name == "stage":
            p.add_argument("stage")
        p.add_argument("--run-dir", type=Path, help="where the stages write (default: the definition's run_dir)")
        p.add_argument("--given", action="append", default=[], metavar="STAGE=PATH",
                       help="use your own output in place of a stage's (a checkpoint, an export, data; a server as "
                            "URL@MODEL)")
    commands["run"].add_argument("--check", action="store_true", help="resolve and check every hand-off, run nothing")
    commands["submit"].add_argument("--dry-run", action="store_true",
                                    help="print every job (command, layout, dependency, memory plan), submit nothing")
    commands["stage"].add_argument("--server-job", action="append", default=[], metavar="STAGE=JOB",
                                   help="the job serving a server stage this stage reads (pipeline.sh submit passes "
                                        "it): only that job's record is trusted")
    args = parser.parse_args(argv)
    if args.command in ("run", "stage"):
        from megatron_mimesis.pipeline.runner import catch_signals_early

        catch_signals_early()

    from megatron_mimesis.compat import prepare_cpu_process

    prepare_cpu_process()
    from megatron_mimesis.pipeline import definition as definitions

    if args.command == "status":  # reads the records and asks the cluster; resolves nothing
        from megatron_mimesis.pipeline.slurm import status

        try:
            return status(definitions.load(args.definition, args.run_dir, _given(args.given)))
        except definitions.PipelineError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
    from megatron_mimesis.pipeline.resolve import resolve
    from megatron_mimesis.pipeline.runner import Runner

    # a chain's jobs plan at the paper's layouts; a stage job runs under SLURM or, by hand, here
    slurm = args.command == "submit" or (args.command == "stage" and bool(os.environ.get("SLURM_JOB_ID")))
    try:
        definition = definitions.load(args.definition, args.run_dir, _given(args.given))
        # a stage job's plans were made at submit, and its launcher plans its own config again before srun
        resolution = resolve(definition, slurm=slurm, plans=args.command != "stage")
    except definitions.PipelineError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.command == "run":
        if args.check:
            for name, resolved in resolution.stages.items():
                state = "done" if resolved.done else "to run"
                plan = f"; {resolved.plan_line}" if resolved.plan_line else ""
                print(f"{name}: {resolved.stage.kind}, {state}{plan}")
            return 0
        return Runner(resolution).run()
    if args.command == "stage":
        resolved = resolution.stages.get(args.stage)
        if resolved is None:
            print(f"error: {definition.path}: no stage {args.stage!r}", file=sys.stderr)
            return 2
        runner = Runner(resolution, slurm=slurm, server_jobs=_given(args.server_job))
        if resolved.stage.kind == "serve":
            return runner.serve_forever(args.stage)
        return runner.run(only=[args.stage])
    from megatron_mimesis.pipeline.slurm import submit

    try:
        return submit(resolution, dry_run=args.dry_run)
    except definitions.PipelineError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
