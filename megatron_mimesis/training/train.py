"""Mid-training / SFT on megatron-core: the whole loop, top to bottom.

Run under torchrun (``launch/midtrain.sh`` / ``launch/sft.sh`` do that, on SLURM or locally)::

    python -m megatron_mimesis.training.train --config launch/configs/midtrain_9b.yaml [--flag value ...]

Both stages are the same loop over packed rows with a loss mask (user turns for mid-training, thinking +
utterance targets for SFT); they differ only in data and hyperparameters. Everything parallel is
megatron-core's: model chunks per (virtual) pipeline stage, DDP with fp32 main grads, the distributed
optimizer, the 1F1B / interleaved schedules, the param scheduler, dist checkpointing.
"""

import contextlib
import datetime
import json
import math
import os
import sys
import time
import traceback
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_mimesis.compat import prepare_cpu_process
from megatron_mimesis.lifetime import tie_rank_to_launcher
from megatron_mimesis.training.config import ConfigError, TrainConfig, parse_config
from megatron_mimesis.training.model import model_chunks, model_config, wrap_in_ddp

TOKENIZER_SHA256 = "tokenizer_sha256"  # run_config.json: the data manifest's hash of the tokenizer trained with


def check_data(config: TrainConfig) -> dict:
    """Refuse a dataset whose rows or tokenizer do not fit the model, before any process group starts; with
    ``load``, also one prepared with another tokenizer than the checkpoint's (token ids would mean other text,
    and the checkpoint saved next would carry the dataset's tokenizer as its own)."""
    from megatron_mimesis.training.data import check_worker_shared_memory, dataset_manifest

    check_worker_shared_memory(config.num_workers)

    try:
        manifest = dataset_manifest(config.data_path)
    except FileNotFoundError as exc:
        raise ConfigError(str(exc)) from None
    if manifest.get("seq_length") != config.seq_length:
        raise ConfigError(
            f"{config.data_path}: rows are {manifest.get('seq_length')} tokens, seq_length is {config.seq_length}"
        )
    vocab = manifest.get("tokenizer", {}).get("vocab_size")
    if vocab is None or vocab > config.preset.vocab_size:
        raise ConfigError(
            f"{config.data_path}: tokenizer vocab {vocab} does not fit the model vocab {config.preset.vocab_size}"
        )
    if config.load:
        check_tokenizer_matches_checkpoint(config.load, config.data_path, manifest["tokenizer"])
    return manifest


def check_tokenizer_matches_checkpoint(load: str, data_path: str, tokenizer: dict) -> None:
    """The tokenizer sha256 the data manifest records against the one the checkpoint's run recorded."""
    from megatron_mimesis.checkpoint.reader import RUN_CONFIG, CheckpointError, newest_complete

    try:
        path, _ = newest_complete(load)
    except CheckpointError as exc:
        raise ConfigError(f"load: {exc}") from None
    run_config = json.loads((path / RUN_CONFIG).read_text()) if (path / RUN_CONFIG).is_file() else {}
    saved = run_config.get(TOKENIZER_SHA256)
    if saved is None and os.environ.get("RANK", "0") == "0":
        print(f"warning: {path} records no tokenizer (imported, or saved before the record existed); "
              f"{data_path} is trusted to use its tokenizer", file=sys.stderr)
    elif saved is not None and saved != tokenizer.get("sha256"):
        raise ConfigError(
            f"{data_path}: prepared with another tokenizer (sha256 {str(tokenizer.get('sha256'))[:12]}) than the "
            f"checkpoint {path} ({saved[:12]}); prepare the data with --tokenizer {path}/tokenizer"
        )


class Trainer:
    """Process groups, model chunks, optimizer and schedule of one run; ``run`` is the supervised loop.

    The RL stages reuse the construction (and the checkpointing) with their own loop.
    """

    def __init__(self, config: TrainConfig, tokenizer_dir: str | Path):
        from megatron.core import parallel_state
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

        from megatron_mimesis.compat import compute_device, enable_cpu_compat

        self.config = config
        self.tokenizer_dir = tokenizer_dir
        cpu = enable_cpu_compat()
        if not dist.is_initialized():
            dist.init_process_group("gloo" if cpu else "nccl",
                                    timeout=datetime.timedelta(minutes=config.distributed_timeout_minutes))
        if not cpu:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        self.device = compute_device()
        self.world_size = dist.get_world_size()
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=config.tensor_model_parallel_size,
            pipeline_model_parallel_size=config.pipeline_model_parallel_size,
            virtual_pipeline_model_parallel_size=config.virtual_pipeline_model_parallel_size,
            context_parallel_size=config.context_parallel_size,
            distributed_timeout_minutes=config.distributed_timeout_minutes,
        )
        torch.manual_seed(config.seed)
        model_parallel_cuda_manual_seed(config.seed)
        self.is_logger = dist.get_rank() == 0
        self._build_model_and_optimizer()
        self.checkpoints = None
        if config.save:
            from megatron_mimesis.checkpoint.trainer_state import CheckpointSaver

            self.checkpoints = CheckpointSaver(config.save, asynchronous=config.async_save,
                                               keep_last_n=config.keep_last_n, keep_every=config.keep_every)

    # ------------------------------------------------------------------ setup
    def _build_model_and_optimizer(self):
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

        from megatron_mimesis.models.provider import ModelProvider
        from megatron_mimesis.training.grads import finalize_grads

        c = self.config
        dtype = torch.bfloat16 if c.bf16 else torch.float32
        self.tf_config = model_config(c)
        if c.mtp_loss_scaling_factor:
            from megatron_mimesis.training.mtp_loss import use_fused_mtp_loss

            use_fused_mtp_loss()
        self.provider = ModelProvider(c.preset, self.tf_config)
        chunks = self.build_chunks()
        if c.pretrained_hf:
            self.load_hf(chunks, c.pretrained_hf)
        self.model = wrap_in_ddp(c, self.tf_config, chunks)
        self.tf_config.finalize_model_grads_func = finalize_grads
        if c.overlap_grad_reduce:
            self.tf_config.no_sync_func = [m.no_sync for m in self.model]
            if len(self.model) == 1:
                self.tf_config.no_sync_func = self.tf_config.no_sync_func[0]
        opt_config = OptimizerConfig(
            optimizer="adam", lr=c.lr, min_lr=c.min_lr, weight_decay=c.weight_decay, adam_beta1=c.adam_beta1,
            adam_beta2=c.adam_beta2, adam_eps=c.adam_eps, clip_grad=c.clip_grad, bf16=c.bf16,
            params_dtype=dtype, use_distributed_optimizer=c.use_distributed_optimizer,
        )
        self.optimizer = get_megatron_optimizer(opt_config, self.model)
        self.scheduler = OptimizerParamScheduler(
            self.optimizer, init_lr=0.0, max_lr=c.lr, min_lr=c.min_lr, lr_warmup_steps=c.lr_warmup_iters,
            lr_decay_steps=c.lr_decay_iters or c.train_iters, lr_decay_style=c.lr_decay_style,
            start_wd=c.weight_decay, end_wd=c.weight_decay, wd_incr_steps=c.train_iters, wd_incr_style="constant",
        )

    def build_chunks(self) -> list:
        """This rank's model chunks (one per virtual pipeline stage), unwrapped, on the compute device."""
        return [chunk.to(self.device) for chunk in model_chunks(self.provider, self.config)]

    def load_hf(self, chunks, path: str) -> None:
        from megatron_mimesis.models.hf_io import LazyHFState
        from megatron_mimesis.models.hf_weights import load_hf_weights

        state = LazyHFState(path)
        for chunk in chunks:
            load_hf_weights(chunk, state, self.config.preset, self.provider.padded_vocab_size)

    def _data(self, consumed_samples: int):
        from megatron_mimesis.training.data import build_datasets

        c = self.config
        train_samples = c.train_iters * c.global_batch_size
        evals = (c.train_iters // c.eval_interval + 1) if c.eval_interval else 0
        valid_samples = max(evals * c.eval_iters * c.global_batch_size, 1)
        train, valid = build_datasets(c.data_path, c.seq_length, train_samples, valid_samples, c.seed)
        self.train_iterators = self._iterators(train, train_samples, consumed_samples, c.num_workers)
        self.valid = valid

    def _iterators(self, dataset, total_samples: int, consumed_samples: int, num_workers: int):
        """One iterator per model chunk: the interleaved schedule draws each chunk's micro-batches separately,
        so every chunk gets its own loader over the same samples (as in Megatron-LM)."""
        from megatron_mimesis.training.data import make_loader

        iterators = [iter(make_loader(dataset, total_samples, consumed_samples, self.config.micro_batch_size,
                                      num_workers)) for _ in self.model]
        return iterators if len(iterators) > 1 else iterators[0]

    # ------------------------------------------------------------------ one step
    def _forward_step(self, data_iterator, model):
        from megatron_mimesis.training.data import model_inputs
        from megatron_mimesis.training.loss import document_stats, lm_loss_output_processor, loss_func

        batch = next(data_iterator)
        inputs = model_inputs(batch, self.device)
        output = model(
            inputs["tokens"], inputs["position_ids"], None, labels=inputs["labels"], loss_mask=inputs["loss_mask"],
            packed_seq_params=inputs["packed_seq_params"], output_processor=lm_loss_output_processor,
        )
        return output, partial(loss_func, inputs["loss_mask"], document_stats(batch["cu_seqlens"]).to(self.device))

    def _run_schedule(self, data_iterator, forward_only: bool):
        from megatron.core.pipeline_parallel import get_forward_backward_func

        c = self.config
        num_micro = c.num_microbatches(self.world_size)
        return get_forward_backward_func()(
            forward_step_func=self._forward_step, data_iterator=data_iterator, model=self.model,
            num_microbatches=num_micro, seq_length=c.seq_length * c.micro_batch_size, micro_batch_size=1,
            forward_only=forward_only,
        )

    def _reduce_loss(self, losses) -> tuple[float, int, float, list[float]]:
        """(mean loss over the global batch, loss tokens, attended length per token, each trained MTP layer's mean
        loss), identical on every rank."""
        from megatron.core import parallel_state

        from megatron_mimesis.training.mtp_loss import take_mtp_losses

        mtp_layers = self.tf_config.mtp_num_layers or 0
        total = torch.zeros(4, dtype=torch.float64, device=self.device)
        for item in losses:
            total += torch.cat([item["lm loss"].to(total), item["documents"].to(total)])
        total = torch.cat([total, take_mtp_losses(mtp_layers, self.device).flatten()])
        if parallel_state.get_pipeline_model_parallel_world_size() > 1:
            # only the last stage has losses; share them with the first stage (rank 0 logs)
            dist.all_reduce(total, group=parallel_state.get_pipeline_model_parallel_group())
        dist.all_reduce(total, group=parallel_state.get_data_parallel_group())
        mtp = total[4:].view(-1, 2)
        return ((total[0] / total[1].clamp(min=1)).item(), int(total[1].item()), (total[2] / total[3]).item(),
                (mtp[:, 0] / mtp[:, 1].clamp(min=1)).tolist())

    def train_step(self, data_iterator) -> dict:
        for m in self.model:
            m.zero_grad_buffer()
        self.optimizer.zero_grad()
        losses = self._run_schedule(data_iterator, forward_only=False)
        loss, tokens, attended, mtp_losses = self._reduce_loss(losses)
        lr = self.optimizer.param_groups[0]["lr"]
        result = {"loss": loss, "tokens": tokens, "skipped": True, "grad_norm": None, "lr": lr, "attended": attended,
                  **{f"mtp_{depth}_loss": value for depth, value in enumerate(mtp_losses, 1)}}
        if not math.isfinite(loss):
            return result
        ok, grad_norm, _ = self.optimizer.step()
        if ok:
            self.scheduler.step(increment=1)
        return result | {"skipped": not ok, "grad_norm": grad_norm}

    def evaluate(self) -> float:
        c = self.config
        for m in self.model:
            m.eval()
        loader = self._iterators(self.valid, c.eval_iters * c.global_batch_size, 0, num_workers=0)
        sums = []
        with torch.no_grad():
            for _ in range(c.eval_iters):
                sums.append(self._reduce_loss(self._run_schedule(loader, forward_only=True))[:2])
        for m in self.model:
            m.train()
        tokens = sum(t for _, t in sums)
        return sum(loss * t for loss, t in sums) / max(tokens, 1)

    # ------------------------------------------------------------------ the run
    def restore(self, fresh: dict) -> dict:
        """Where a run starts: ``load`` + ``finetune`` takes the weights only (and ``fresh`` progress), ``load``
        alone resumes everything the checkpoint saved, otherwise ``fresh``."""
        from megatron_mimesis.checkpoint.trainer_state import load_checkpoint, load_model_weights

        c = self.config
        if c.load and c.finetune:
            load_model_weights(c.load, self.model, c.preset)
            self.optimizer.reload_model_params()  # the fp32 main params start from the loaded weights
            return fresh
        if c.load:
            progress = load_checkpoint(c.load, self.model, self.optimizer, self.scheduler, c.preset)
            if self.checkpoints is not None and Path(c.load) == Path(c.save):
                self.checkpoints.last_saved = progress["iteration"]  # already saved, in the save directory
            return progress
        return fresh

    @property
    def resumed_from(self) -> str | None:
        """The checkpoint directory this run continues (``load`` without ``finetune``), None for a start."""
        return self.config.load if self.config.load and not self.config.finetune else None

    def run(self, tokenizer_sha256: str) -> int:
        """The supervised loop over the dataset whose manifest records ``tokenizer_sha256`` (saved with every
        checkpoint, so a later --load can tell whether its data was tokenized alike)."""
        from megatron_mimesis.checkpoint.trainer_state import current_layout
        from megatron_mimesis.models.presets import preset_record
        from megatron_mimesis.training.flops import peak_for_mfu, train_flops_per_token
        from megatron_mimesis.training.run_log import RunLog
        from megatron_mimesis.training.signals import ExitSignal

        c = self.config
        progress = self.restore({"iteration": 0, "consumed_samples": 0, "skipped_iters": 0})
        self._data(progress["consumed_samples"])
        run_config = {"train": c.to_dict(), "preset": preset_record(c.preset), "layout": current_layout(),
                      "padded_vocab_size": self.provider.padded_vocab_size, TOKENIZER_SHA256: tokenizer_sha256}
        log = RunLog(c.log_dir, c.train_iters, progress["iteration"], enabled=self.is_logger, progress=c.progress,
                     wandb_project=c.wandb_project, run_config=run_config, resumed_from=self.resumed_from)
        exit_signal = ExitSignal() if c.exit_signal_handler else None
        peak = peak_for_mfu(torch.cuda.get_device_name() if torch.cuda.is_available() else None, log.message)
        data_iterator = self.train_iterators
        status = 0
        result = {"skipped": False}
        guard = SkipGuard(c.max_consecutive_skipped_iters, c.max_skipped_iters, progress["skipped_iters"])
        stop = None

        def save():
            """A checkpoint of the weights after this step, unless the step was skipped: while the loss is
            non-finite the weights are suspect, and the last checkpoint must stay the one to resume from."""
            if result["skipped"]:
                log.message(f"iteration {progress['iteration']}: no checkpoint while steps are being skipped")
                return
            self.save_checkpoint(progress, run_config)

        while progress["iteration"] < c.train_iters:
            start = time.perf_counter()
            result = self.train_step(data_iterator)
            elapsed = time.perf_counter() - start
            self.poll_checkpoint()
            progress["iteration"] += 1
            progress["consumed_samples"] += c.global_batch_size
            it = progress["iteration"]
            diverged = guard.record(result["skipped"])
            progress["skipped_iters"] = guard.in_run
            if result["skipped"]:
                log.message(f"iteration {it}: non-finite loss or grad, step skipped ({guard})")
            if it % c.log_interval == 0:
                tokens_per_sec = c.global_batch_size * c.seq_length / elapsed
                # causal attention within each packed document: its cost per token follows sum L^2 / sum L
                flops = train_flops_per_token(c.preset, result["attended"], trained_mtp=bool(c.mtp_loss_scaling_factor))
                achieved = tokens_per_sec * flops / self.world_size
                log.step({
                    "iteration": it, "loss": result["loss"], "lr": result["lr"],
                    "grad_norm": result["grad_norm"], "loss_tokens": result["tokens"],
                    "tokens_per_sec": tokens_per_sec, "tokens_per_sec_per_gpu": tokens_per_sec / self.world_size,
                    "tflops_per_gpu": achieved / 1e12, "mfu": achieved / peak if peak else None,
                    "attended_length": result["attended"],
                    "step_time_s": elapsed, "skipped_iters": progress["skipped_iters"],
                    "consumed_samples": progress["consumed_samples"], "max_memory_gb": _max_memory_gb(),
                    **{k: v for k, v in result.items() if k.startswith("mtp_")},
                })
            if diverged:
                log.message(f"{diverged}; stopping without saving (the last checkpoint is intact)")
                status = 1
                break
            if c.eval_interval and it % c.eval_interval == 0 and self.valid is not None:
                log.step({"iteration": it, "split": "valid", "loss": self.evaluate()})
            stop = save_and_maybe_stop(c, it, exit_signal, log, save)
            if stop:
                break
        else:
            save_final(c, progress["iteration"], save)
        self.end_run(log, stop, exit_signal, progress["iteration"])
        return status

    def save_checkpoint(self, progress: dict, run_config: dict) -> None:
        """Checkpoint the state after ``progress["iteration"]`` (written in the background with ``async_save``)."""
        self.checkpoints.save(progress["iteration"], self.model, self.optimizer, self.scheduler, dict(progress),
                              run_config, tokenizer_dir=self.tokenizer_dir)

    def has_saved(self, iteration: int) -> bool:
        """Whether the save directory holds ``iteration``'s checkpoint, written (or resumed from) by this run."""
        return self.checkpoints is not None and self.checkpoints.last_saved == iteration

    def poll_checkpoint(self) -> None:
        """Publish a background save whose write has finished (once per step, on every rank)."""
        if self.checkpoints is not None:
            self.checkpoints.poll()

    def wait_for_checkpoint(self) -> None:
        """Publish the background save in flight, waiting for it: before the run ends."""
        if self.checkpoints is not None:
            self.checkpoints.wait()

    def end_run(self, log, stop: str | None, exit_signal, iteration: int) -> None:
        """The end of any stage's loop: publish the save in flight, then, after a stop on a preemption signal, tell
        the launcher (``exit.json``) whether ``iteration``'s checkpoint is in the save directory; close the log."""
        self.wait_for_checkpoint()
        if stop == "signal":
            log.stopped_for_requeue(iteration, exit_signal.received, self.has_saved(iteration))
        log.close()


class SkipGuard:
    """The NaN guard's two caps: ``in_a_row`` skipped steps mean a divergence; ``in_run`` (carried across resumes)
    bounds isolated skips, so that a long run is not stopped by a handful of them spread over days."""

    def __init__(self, max_in_a_row: int, max_in_run: int, in_run: int = 0):
        self.max_in_a_row, self.max_in_run = max_in_a_row, max_in_run
        self.in_a_row, self.in_run = 0, in_run

    def record(self, skipped: bool) -> str | None:
        """Count one step; the reason to stop, when a cap is reached."""
        self.in_a_row = self.in_a_row + 1 if skipped else 0
        self.in_run += skipped
        if self.in_a_row >= self.max_in_a_row:
            return f"{self.in_a_row} skipped iterations in a row (max_consecutive_skipped_iters)"
        if skipped and self.in_run >= self.max_in_run:
            return f"{self.in_run} skipped iterations in the run (max_skipped_iters)"
        return None

    def __str__(self) -> str:
        return f"{self.in_a_row}/{self.max_in_a_row} in a row, {self.in_run}/{self.max_in_run} in the run"


def save_and_maybe_stop(config, iteration: int, exit_signal, log, save) -> str | None:
    """End of a step in any stage's loop: the periodic checkpoint, then a stop (saved first) on a preemption
    signal or at ``exit_interval``. Returns why the loop must stop ("signal", "exit_interval"), or None."""
    saved = bool(config.save and config.save_interval and iteration % config.save_interval == 0)
    if saved:
        save()
    stop = None
    if exit_signal is not None and exit_signal.any_rank_received():
        stop, line = "signal", f"exit signal received at iteration {iteration}: saving and exiting for requeue"
    elif config.exit_interval and iteration % config.exit_interval == 0 and iteration < config.train_iters:
        stop, line = "exit_interval", f"exit_interval reached at iteration {iteration}: saving and exiting"
    if stop:
        log.message(line)
        if config.save and not saved:
            save()
    return stop


def save_final(config, iteration: int, save) -> None:
    """The checkpoint of a finished run, unless the periodic one just wrote it."""
    if config.save and (not config.save_interval or iteration % config.save_interval):
        save()


def _max_memory_gb() -> float | None:
    return torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None


def main(argv: list[str] | None = None) -> int:
    prepare_cpu_process()  # before megatron-core is imported: its import warns and applies torch.compile
    tie_rank_to_launcher()
    config, args = parse_config(argv)
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    try:
        config, resuming = config.resolve_start()
        config.validate(world_size)
        manifest = check_data(config)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.dry_run:
        from megatron_mimesis.training.memory.plan import plan_training

        resolved = {"config": config.to_dict(), "world_size": world_size, "resuming": resuming,
                    "data_parallel_size": config.data_parallel_size(world_size),
                    "num_microbatches": config.num_microbatches(world_size),
                    "tokens_per_step": config.global_batch_size * config.seq_length}
        return dry_run(config, world_size, plan_training(config, world_size), resolved, args.check_save_dir,
                       args.check_shutdown_timeout, args.check_endpoints)
    if not start_run(config, world_size, resuming):
        return 2
    tokenizer = manifest["tokenizer"]
    return run_to_completion(lambda: Trainer(config, tokenizer["path"]).run(tokenizer["sha256"]), config.log_dir)


def announce(line: str | None) -> None:
    """A line about the run as a whole (where it starts), once: on rank 0."""
    if line and os.environ.get("RANK", "0") == "0":
        print(line, file=sys.stderr, flush=True)


def dry_run(config, world_size: int, planned: tuple, resolved: dict, check_save_dir: bool,
            shutdown_timeout_s: int | None = None, check_endpoints: bool = False) -> int:
    """What ``--dry-run`` prints and exits with: the memory plan (``planned``: the plan and its refusal) with the
    resolved config; with ``check_save_dir`` (the launchers' pre-check) also whether ``save`` has room for the run's
    checkpoints, from the plan's checkpoint size; with ``shutdown_timeout_s`` (the job's SHUTDOWN_TIMEOUT, under
    SLURM) whether the ranks get the time the run needs to stop and save on a pre-timeout signal. An sbatch file
    serves several configs, and one whose checkpoints or phases are larger would lose its stop save. With
    ``check_endpoints``, every endpoint the run will call is asked (``training/endpoints.py``)."""
    from megatron_mimesis.training.endpoints import check_endpoints as ask_endpoints
    from megatron_mimesis.training.memory.plan import print_plan
    from megatron_mimesis.training.save_dir import check_save_dir as check

    status = print_plan(*planned, resolved)
    if status != 0:
        return status
    details = planned[0].details
    try:
        if check_save_dir:
            check(config, world_size, details["checkpoint_bytes"])
        if shutdown_timeout_s is not None and shutdown_timeout_s < details["shutdown_timeout_s"]:
            raise ConfigError(
                f"SHUTDOWN_TIMEOUT {shutdown_timeout_s} s is less than the {details['shutdown_timeout_s']} s this run "
                f"needs to stop and save on SLURM's pre-timeout signal (its longest phase and two checkpoint writes: "
                f"training/lead_times.py): submit with SHUTDOWN_TIMEOUT={details['shutdown_timeout_s']} sbatch "
                f"--signal=B:USR1@{details['signal_lead_s']} ...")
        if check_endpoints:
            ask_endpoints(config.endpoints())
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return status


def start_run(config, world_size: int, resuming: str | None) -> bool:
    """A rank's last checks before any work, which a save directory without room would lose: the endpoints the run
    calls (``training/endpoints.py``, on rank 0: a server may have gone since the launcher asked), the save directory
    (``training/save_dir.py``: unless the launcher checked it, on rank 0), then the line saying where the run starts
    and its log directory. False, after the one-line error, when an endpoint does not answer or the save directory
    cannot take the run's checkpoints."""
    from megatron_mimesis.training.endpoints import check_endpoints
    from megatron_mimesis.training.save_dir import check_save_dir, needs_check_here

    try:
        if os.environ.get("RANK", "0") == "0":
            check_endpoints(config.endpoints())
        if needs_check_here():
            check_save_dir(config, world_size)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return False
    announce(resuming)
    Path(config.log_dir).mkdir(parents=True, exist_ok=True)
    return True


def run_to_completion(run, log_dir: str | Path) -> int:
    """Run a loop on every rank and close the process groups.

    An error ends the rank at once, its helper processes with it (:func:`megatron_mimesis.failures.exit_now`), and
    is reported in one line. A configuration or checkpoint problem that only shows once the run is set up (a
    checkpoint of another model, say) exits 2 with its reason; a failed save exits 1 with the failing rank's reason.
    Every rank meets those two alike, so rank 0 reports them. Anything else exits 1, each rank naming its own error
    and its root cause, the traceback kept in ``log_dir/error-rank{R}.txt``.
    """
    try:
        status = run()
    except (Exception, KeyboardInterrupt) as exc:
        _report_and_exit(exc, Path(log_dir))
    dist.barrier()
    dist.destroy_process_group()
    return status


def _report_and_exit(exc: BaseException, log_dir: Path):
    from megatron_mimesis.checkpoint.reader import CheckpointError
    from megatron_mimesis.checkpoint.trainer_state import CheckpointSaveError
    from megatron_mimesis.failures import exit_now, one_line
    from megatron_mimesis.training.run_log import write_exit_record

    rank, world_size = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    expected = isinstance(exc, ConfigError | CheckpointError)
    alike = expected or isinstance(exc, CheckpointSaveError)
    line = str(exc) if alike else one_line(exc)
    if not expected:
        path = log_dir / f"error-rank{rank}.txt"
        text = "".join(traceback.format_exception(exc))
        try:
            path.write_text(text)
            line += f" (traceback: {path})"
        except OSError:
            print(text, file=sys.stderr, end="")
    if rank == 0 or not alike:
        line = f"{f'rank {rank}: ' if world_size > 1 and not alike else ''}{line}"
        print(f"error: {line}", file=sys.stderr)
        if rank == 0:  # the launcher repeats it after torchrun's own report of the failure
            with contextlib.suppress(OSError):
                write_exit_record(log_dir, {"stopped": "error", "error": line})
    exit_now(2 if expected else 1)


if __name__ == "__main__":
    sys.exit(main())
