"""A run resumed from the checkpoint of step N owns its log from step N + 1 on: no step appears twice."""

import json

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
