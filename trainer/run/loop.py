"""The training loop, run by every worker (or in-process on one device).

:func:`train` reads top to bottom and calls its parts, each a named unit in its own room:

    data (trainer.data) -> model, optimizer and LR schedule, loader, loss (trainer.run.build)
    -> resume (trainer.run.checkpointing) -> per step: train_step (trainer.run.step), logging
    (trainer.run.metrics.StepLog), evaluation, checkpoint -> timeline pictures, memory summary.

Rank-0-only side effects (progress bar, metrics) go through a tracker and a progress
object that are null objects on the other ranks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from parallel.engine import ParallelModel
from parallel.plan.serial import ResolvedPlan
from parallel.pipeline.timeline import TimelineRecorder
from trainer.config.schema import HFModelConfig, RunConfig
from trainer.data import build_splits
from trainer.models import decoder_config
from trainer.models.hf import model_dir, weight_files
from trainer.pictures.timeline_chart import timeline_pictures
from trainer.planner.memory.budget import predicted_peak_mib as budgeted_peak_mib
from trainer.planner.memory.host import unmap_freed_memory
from trainer.run.build import build_loader, build_loss, build_optimizer, build_parallel_model, lr_lambda
from trainer.run.checkpointing import Checkpointer, frozen_names
from trainer.run.final_model import log_final_model, logs_final_model
from trainer.run.metrics import MemoryMeter, NullProgress, StepLog
from trainer.run.step import StepStats, evaluate, train_step
from trainer.run.stop_request import StopRequest
from trainer.tracking.end_of_run import AfterTraining
from trainer.tracking.tracker import Tracker

# lr_lambda and frozen_names: the loop's names for its schedule and LoRA's frozen weights, kept here too
__all__ = ["TrainResult", "evaluate", "frozen_names", "lr_lambda", "resolve_device", "train"]


@dataclass
class TrainResult:
    """What a finished (or stopped) loop reports back to the launcher."""

    losses: list[float] = field(default_factory=list)
    first_step: int = 0
    val_loss: float | None = None  # the last evaluation's, when there is a validation split
    step_times: list[float] = field(default_factory=list)  # seconds per optimizer step, this run's steps
    aux_losses: list[float] = field(default_factory=list)  # an MoE model's balance loss per step (unweighted)
    grad_norms: list[float] = field(default_factory=list)  # the gradient norm per step, before clipping
    tokens_per_step: int = 0
    last_checkpoint: str | None = None
    pictures: dict[str, str] = field(default_factory=dict)  # rank 0: timeline_trace, timeline_png -> file
    # the last step line's window: first, last step, and its means (loss, tokens_per_s, ...), as printed
    last_window: dict = field(default_factory=dict)
    peak_memory_mb: float | None = None  # the largest rank's peak at the last logged step
    stopped_at: int | None = None  # the step after which a stop request (Slurm's warning) ended the run early
    end_of_run_errors: list[str] = field(default_factory=list)  # what failed after the last step (one line each)

    @property
    def mean_tokens_per_s(self) -> float | None:
        """Tokens per second over the run's steps, the first (start-up, compilation) left out when there are more."""
        times = self.step_times[1:] or self.step_times
        return self.tokens_per_step * len(times) / sum(times) if times and sum(times) > 0 else None

    def summary(self) -> dict:
        """What the launcher's end-of-run summary needs, JSON-friendly (a worker returns it)."""
        return {"losses": self.losses, "first_step": self.first_step, "val_loss": self.val_loss,
                "step_times": self.step_times, "tokens_per_step": self.tokens_per_step,
                "last_checkpoint": self.last_checkpoint, "pictures": self.pictures, "last_window": self.last_window,
                "peak_memory_mb": self.peak_memory_mb, "stopped_at": self.stopped_at,
                "end_of_run_errors": self.end_of_run_errors}

    def add(self, stats: StepStats) -> None:
        """One step's numbers."""
        self.losses.append(stats.loss)
        self.step_times.append(stats.seconds)
        self.grad_norms.append(stats.grad_norm)
        if stats.aux_loss is not None:
            self.aux_losses.append(stats.aux_loss)


def resolve_device(device: str, device_index: int = 0) -> torch.device:
    """This worker's device for ``device: auto | cpu | cuda``: GPU ``device_index`` of its host
    (selected as current), or the CPU (see :func:`trainer.launch.worker.bind_worker` for the index)."""
    if device == "cuda" or (device == "auto" and torch.cuda.is_available()):
        torch.cuda.set_device(device_index)
        return torch.device("cuda", device_index)
    return torch.device("cpu")


def train(cfg: RunConfig, *, tracker: Tracker, progress: NullProgress, rank: int = 0, device_index: int = 0,
          pictures_dir: str | None = None, predicted_peak_mib: float | None = None,
          plan: ResolvedPlan | None = None) -> TrainResult:
    """Run ``cfg.train.steps`` optimizer steps (from a checkpoint when resuming) on GPU
    ``device_index`` of the host, or the CPU; rank 0 draws the timeline into ``pictures_dir``.
    ``predicted_peak_mib``: the plan's peak as the launcher priced it (else rank 0 prices it).
    ``plan``: the launcher's resolved plan, checked against this rank's model build (else resolved for it)."""
    t = cfg.train
    device = resolve_device(cfg.device, device_index)
    torch.manual_seed(t.seed)
    splits = build_splits(cfg.data, seq_len=t.seq_len, model_cfg=decoder_config(cfg.model) or cfg.model,
                          model_path=getattr(cfg.model, "path", None))
    if cfg.launch.unmap_freed_memory and device.type == "cpu":
        unmap_freed_memory()
    meter = MemoryMeter(device)  # from here on: the model's memory, beside the plan's prediction
    if rank == 0:
        _report_predicted_peak(cfg, tracker, progress, predicted_peak_mib, plan)
    pm = build_parallel_model(cfg, device, plan=plan)
    optimizer, scheduler = build_optimizer(pm, cfg.optim, total_steps=t.steps)
    for note in splits.notes:
        progress.log(note)
    loader = build_loader(splits.train, pm, t)
    loss_fn = build_loss(cfg, pm, masked=hasattr(splits.train, "target_count"))
    checkpointer = Checkpointer(cfg, pm, optimizer, scheduler, loader)
    start = checkpointer.resume(tracker=tracker, progress=progress)
    result = TrainResult(first_step=start, tokens_per_step=t.global_batch_size * t.seq_len)
    log = StepLog(total_steps=t.steps, log_every=t.log_every, tokens_per_step=result.tokens_per_step, tracker=tracker,
                  progress=progress, meter=meter, peaks_of_ranks=lambda mine: _per_rank(mine, pm, device))
    recorder = TimelineRecorder(pm)  # the last timeline_steps steps: start-up is not in the picture
    record_from = t.steps - cfg.tracking.timeline_steps + 1 if cfg.tracking.pictures else t.steps + 1
    validate = _Validation(cfg, pm, splits.val, device, tracker, progress)
    if validate.at_start(resumed=start > 0):  # a baseline before any update
        validate(start)
    stop = StopRequest.from_environment(distributed=torch.distributed.is_initialized(), device=device, rank=rank)
    progress.start(total=t.steps, completed=start, every_s=t.progress_every_s)
    for step in range(start + 1, t.steps + 1):
        stats = train_step(pm, loader, loss_fn, optimizer, scheduler, cfg=cfg, device=device, recorder=recorder,
                           step=step, record=step >= record_from)
        result.add(stats)
        log.record(step, stats)
        if validate.due(step):
            result.val_loss = validate(step)
        if checkpointer.due(step):
            result.last_checkpoint = checkpointer.save(step, rank=rank, tracker=tracker, progress=progress)
        if step < t.steps and stop.requested():  # Slurm's warning: the job resumes from here when requeued
            if not checkpointer.due(step):
                result.last_checkpoint = checkpointer.save(step, rank=rank, tracker=tracker, progress=progress)
            progress.log(f"stopped after step {step} as asked (checkpoint {result.last_checkpoint})")
            result.stopped_at = step
            break
    progress.stop()
    _after_training(result, cfg, log=log, recorder=recorder, model_state=checkpointer.model, tracker=tracker,
                    progress=progress, pictures_dir=pictures_dir)
    return result


def _after_training(result: TrainResult, cfg: RunConfig, *, log: StepLog, recorder: TimelineRecorder, model_state,
                    tracker: Tracker, progress: NullProgress, pictures_dir) -> None:
    """After the last step: the memory peaks, the timeline pictures and the final model. What fails here is
    reported and recorded (``result.end_of_run_errors``), and the training still finished."""
    after = AfterTraining(tracker, say=progress.log)
    with after.guard("the per-rank memory peaks (MLflow metrics/)"):
        log.finish()
    finished = result.stopped_at is None  # a stopped run resumes when requeued: its pictures and model come then
    if cfg.tracking.pictures and finished:  # a collective: every rank gathers its actions to rank 0, which draws them
        with after.guard("the timeline pictures"):
            result.pictures = timeline_pictures(recorder, cfg, tracker=tracker, progress=progress,
                                                out_dir=pictures_dir)
    if logs_final_model(cfg) and finished:  # a collective: every rank sends its weights to rank 0, which logs them
        with after.guard("the final model (MLflow model/)", required=cfg.tracking.log_model is True):
            log_final_model(cfg, model_state, tracker=tracker, progress=progress)
    result.end_of_run_errors = after.errors
    result.last_window, result.peak_memory_mb = log.last_window, log.peak_memory_mb


def _report_predicted_peak(cfg: RunConfig, tracker: Tracker, progress: NullProgress, predicted: float | None,
                           plan: ResolvedPlan | None) -> None:
    """Rank 0: the plan's predicted peak per rank (priced here when the launcher did not), to set the
    measured one beside."""
    try:
        predicted = predicted if predicted is not None else budgeted_peak_mib(cfg, plan.plan if plan else None)
    except Exception as err:  # noqa: BLE001 - a model the meta device cannot run is trained, not predicted
        progress.log(f"memory: no prediction ({type(err).__name__}: {str(err)[:100]})")
    else:
        tracker.log_summary({"predicted_peak_memory_mb": predicted})  # one number: the overview, not a chart
        progress.log(f"memory: predicted peak {predicted:,.0f} MiB per rank")


class _Validation:
    """Evaluation on the validation split (none without one): at the start when weights were loaded,
    every ``train.eval_every`` steps and after the last; each logged as ``val_loss`` and ``val_perplexity``."""

    def __init__(self, cfg: RunConfig, pm: ParallelModel, source, device: torch.device, tracker: Tracker,
                 progress: NullProgress) -> None:
        self.cfg, self.pm, self.source, self.device = cfg, pm, source, device
        self.tracker, self.progress = tracker, progress

    def at_start(self, *, resumed: bool) -> bool:
        return self.source is not None and _eval_at_start(self.cfg, resumed=resumed)

    def due(self, step: int) -> bool:
        t = self.cfg.train
        return self.source is not None and ((t.eval_every and step % t.eval_every == 0) or step == t.steps)

    def __call__(self, step: int) -> float:
        """Evaluate now (after ``step``) and log it; returns the validation loss."""
        val_loss = evaluate(self.pm, self.source, self.cfg, self.device)
        _log_val(val_loss, step, self.cfg, self.tracker, self.progress)
        return val_loss


def _eval_at_start(cfg: RunConfig, *, resumed: bool) -> bool:
    """``train.eval_at_start``, or when null: weights were loaded (a Hugging Face directory's
    safetensors, ``train.init_from``) and the run starts fresh (a resumed run's first run evaluated)."""
    if cfg.train.eval_at_start is not None:
        return cfg.train.eval_at_start
    hf_weights = isinstance(cfg.model, HFModelConfig) and bool(weight_files(model_dir(cfg.model)))
    loaded = bool(cfg.train.init_from) or hf_weights
    return loaded and not resumed


def _log_val(val_loss: float, step: int, cfg: RunConfig, tracker: Tracker, progress: NullProgress) -> None:
    """``val_loss`` and ``val_perplexity`` to the tracker at ``step``, and a console line."""
    metrics = {"val_loss": val_loss, "val_perplexity": math.exp(min(val_loss, 700))}
    tracker.log_metrics(metrics, step=step)
    progress.log(f"step {step}/{cfg.train.steps} | val_loss {val_loss:.4f} | val_perplexity "
                 f"{metrics['val_perplexity']:.2f}")


def _per_rank(value: float, pm: ParallelModel, device: torch.device) -> list[float]:
    """``value`` of every rank, in rank order (a collective: every rank calls it)."""
    if pm.mesh is None:
        return [value]
    import torch.distributed as dist

    mine = torch.tensor([value], dtype=torch.float64, device=device)
    everyone = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, mine)
    return [float(v) for v in everyone]
