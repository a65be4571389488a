"""A run resumed from the checkpoint of step N owns its log from step N + 1 on: no step appears twice."""

import json
import re

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from megatron_mimesis.training.run_log import RunLog


def _log(log_dir, start_iter, iterations, loss):
    log = RunLog(log_dir, 10, start_iter, enabled=True, progress=False)
    for it in iterations:
        log.step({"iteration": it, "loss": loss(it)})
        if it == 2:
            log.step({"iteration": it, "split": "valid", "loss": 9.0})
    log.close()


def test_resume_truncates_the_steps_after_the_checkpoint(tmp_path):
    # the first attempt logged steps 1-5 and died writing step 6; its last checkpoint was step 3
    _log(tmp_path, 0, range(1, 6), lambda it: 10.0 - it)
    with (tmp_path / "metrics.jsonl").open("a") as handle:
        handle.write('{"iteration": 6, "lo')
    _log(tmp_path, 3, range(4, 7), lambda it: 100.0 + it)
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["iteration"], r.get("split"), r["loss"]) for r in records] == [
        (1, None, 9.0), (2, None, 8.0), (2, "valid", 9.0), (3, None, 7.0), (4, None, 104.0), (5, None, 105.0),
        (6, None, 106.0)]
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("train/loss")] == [
        (1, 9.0), (2, 8.0), (3, 7.0), (4, 104.0), (5, 105.0), (6, 106.0)]


def test_a_fresh_run_starts_a_fresh_log(tmp_path):
    _log(tmp_path, 0, range(1, 4), lambda it: 1.0)
    _log(tmp_path, 0, range(1, 3), lambda it: 2.0)
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["iteration"], r["loss"]) for r in records if "split" not in r] == [(1, 2.0), (2, 2.0)]


def test_without_a_terminal_each_logged_step_is_one_line_with_its_progress(tmp_path, capsys):
    """What a SLURM job's slurm-*.out shows: the step of total, the headline figures, throughput, MFU, elapsed, ETA."""
    log = RunLog(tmp_path, 200, 100, enabled=True, progress=True)  # a resume from step 100; pytest's stderr is no tty
    log.step({"iteration": 110, "loss": 2.31415, "lr": 3e-5, "tokens_per_sec": 41234.5, "mfu": 0.3812})
    log.step({"iteration": 110, "split": "valid", "loss": 2.5})
    log.step({"iteration": 200, "loss": 2.0, "lr": 3e-6})
    log.close()
    lines = capsys.readouterr().out.splitlines()
    assert re.fullmatch(r"step 110/200 \| loss 2\.314 \| lr 3e-05 \| 41\.2k tokens/s \| MFU 38\.1% \| elapsed \d+s \| "
                        r"ETA \d+s", lines[0]), lines
    assert lines[1] == "step 110/200 | valid loss 2.5"
    assert re.fullmatch(r"step 200/200 \| loss 2 \| lr 3e-06 \| elapsed \d+s", lines[2]), lines  # done: no ETA


def test_a_run_that_resumes_a_checkpoint_continues_its_wandb_run(tmp_path, monkeypatch):
    """Real wandb, offline: the id a run gets is kept in the run config its checkpoints save, and a run resumed from
    such a checkpoint logs to the same W&B run; a run that starts afresh gets a new one."""
    pytest.importorskip("wandb")
    from megatron_mimesis.checkpoint.reader import RUN_CONFIG

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    first_config = {"train": {"lr": 1.0}}
    log = RunLog(tmp_path / "log", 10, 0, enabled=True, progress=False, wandb_project="mimesis-test",
                 run_config=first_config)
    log.step({"iteration": 1, "loss": 1.0})
    log.close()
    run_id = first_config["wandb_run_id"]
    checkpoint = tmp_path / "ckpt" / "iter_0000001"  # what the saver writes: run_config.json, with the id
    checkpoint.mkdir(parents=True)
    (checkpoint / RUN_CONFIG).write_text(json.dumps(first_config))
    (tmp_path / "ckpt" / "latest").write_text("1\n")
    resumed_config = {"train": {"lr": 1.0}}
    log = RunLog(tmp_path / "log", 10, 1, enabled=True, progress=False, wandb_project="mimesis-test",
                 run_config=resumed_config, resumed_from=tmp_path / "ckpt")
    log.step({"iteration": 2, "loss": 0.5})
    log.close()
    assert resumed_config["wandb_run_id"] == run_id
    fresh_config = {}
    RunLog(tmp_path / "log", 10, 0, enabled=True, progress=False, wandb_project="mimesis-test",
           run_config=fresh_config).close()
    assert fresh_config["wandb_run_id"] != run_id
    runs = sorted(p.name.rsplit("-", 1)[1] for p in (tmp_path / "log" / "wandb").glob("offline-run-*"))
    assert sorted(runs) == sorted([run_id, run_id, fresh_config["wandb_run_id"]]), runs
