"""The training loop, run by every worker (or in-process on one device).

build model -> parallelize -> optimizer, LR schedule, data -> resume -> steps -> checkpoints.
Rank-0-only side effects (progress bar, metrics) go through a tracker and a progress
object that are null objects on the other ranks.
"""

from __future__ import annotations

import json
import math
import random
import time
from dataclasses import dataclass, field

import torch

from parallel.engine import ParallelModel
from parallel.pipeline.timeline import TimelineRecorder
from trainer.checkpoint.dcp import (
    check_model_config,
    checkpoint_bytes,
    load_checkpoint,
    merged_module,
    read_extra,
    resolve_resume,
    save_checkpoint,
)
from trainer.config.schema import HFModelConfig, OptimConfig, RunConfig
from trainer.data import Source, build_splits
from trainer.data.loader import GlobalBatchLoader
from trainer.models import TargetMeanLoss, decoder_config, loss_fn_for
from trainer.models.fingerprint import check_fingerprints, model_fingerprints
from trainer.models.hf import weight_files
from trainer.models.init import canonical_fqn
from trainer.models.moe import WithAuxLoss, with_aux_loss
from trainer.pictures.timeline_chart import timeline_pictures
from trainer.planner.memory.budget import predicted_peak_mib as budgeted_peak_mib
from trainer.planner.memory.host import unmap_freed_memory
from trainer.run.build import build_parallel_model
from trainer.run.disk import naming_a_full_disk, state_bytes
from trainer.run.metrics import MemoryMeter, Progress
from trainer.tracking.tracker import Tracker


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
                "peak_memory_mb": self.peak_memory_mb}


def lr_lambda(optim: OptimConfig, total_steps: int):
    """Multiplier of the peak lr at a step: linear warm-up, then cosine / linear decay / constant."""

    warmup = optim.warmup_steps_for(total_steps)

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / (warmup + 1)
        if optim.schedule == "constant":
            return 1.0
        progress = (step - warmup) / max(1, total_steps - warmup)
        progress = min(1.0, progress)
        decay = 0.5 * (1 + math.cos(math.pi * progress)) if optim.schedule == "cosine" else 1 - progress
        return optim.min_lr_ratio + (1 - optim.min_lr_ratio) * decay

    return factor


def resolve_device(device: str, device_index: int = 0) -> torch.device:
    """This worker's device for ``device: auto | cpu | cuda``: GPU ``device_index`` of its host
    (selected as current), or the CPU (see :func:`trainer.launch.worker.bind_worker` for the index)."""
    if device == "cuda" or (device == "auto" and torch.cuda.is_available()):
        torch.cuda.set_device(device_index)
        return torch.device("cuda", device_index)
    return torch.device("cpu")


def train(cfg: RunConfig, *, tracker: Tracker, progress: Progress, rank: int = 0, device_index: int = 0,
          pictures_dir: str | None = None, predicted_peak_mib: float | None = None) -> TrainResult:
    """Run ``cfg.train.steps`` optimizer steps (from a checkpoint when resuming) on GPU
    ``device_index`` of the host, or the CPU; rank 0 draws the timeline into ``pictures_dir``.
    ``predicted_peak_mib``: the plan's peak as the launcher priced it (else rank 0 prices it)."""
    t = cfg.train
    device = resolve_device(cfg.device, device_index)
    torch.manual_seed(t.seed)
    splits = build_splits(cfg.data, seq_len=t.seq_len, model_cfg=decoder_config(cfg.model) or cfg.model,
                          model_path=getattr(cfg.model, "path", None))
    source, val_source = splits.train, splits.val
    if cfg.launch.unmap_freed_memory and device.type == "cpu":
        unmap_freed_memory()
    meter = MemoryMeter(device)  # from here on: the model's memory, beside the plan's prediction
    if rank == 0:
        try:
            predicted = predicted_peak_mib if predicted_peak_mib is not None else budgeted_peak_mib(cfg)
        except Exception as err:  # noqa: BLE001 - a model the meta device cannot run is trained, not predicted
            progress.log(f"memory: no prediction ({type(err).__name__}: {str(err)[:100]})")
        else:
            tracker.log_summary({"predicted_peak_memory_mb": predicted})  # one number: the overview, not a chart
            progress.log(f"memory: predicted peak {predicted:,.0f} MiB per rank")
    pm = build_parallel_model(cfg, device)
    # LoRA: only the adapters train; frozen base weights get no gradient and no AdamW state.
    optimizer = torch.optim.AdamW(
        [p for p in pm.parameters() if p.requires_grad], lr=cfg.optim.lr, betas=cfg.optim.betas, eps=cfg.optim.eps,
        weight_decay=cfg.optim.weight_decay,
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg.optim, t.steps))
    for note in splits.notes:
        progress.log(note)
    # One loader batch is one accumulation batch; the loader position is global, so a resume
    # on another dp size continues at the same sample.
    loader = GlobalBatchLoader(source, global_batch_size=t.global_batch_size // t.grad_accum,
                               dp_rank=pm.dp_rank, dp_size=pm.dp_size, seed=t.seed, cp_rank=pm.cp_rank, cp_size=pm.cp_size)
    # An MoE model trains on its loss plus its weighted balance loss; evaluation is on its loss alone.
    loss_fn = with_aux_loss(loss_fn_for(cfg.model, masked=hasattr(source, "target_count"),
                                          chunk_tokens=cfg.train.loss_chunk_tokens), pm.model_parts,
                            decoder_config(cfg.model), pipelined=pm.pipelined)  # a Hugging Face MoE's from its config.json
    eval_loss_fn = getattr(loss_fn, "base", loss_fn)
    result = TrainResult()
    ckpt_kwargs = dict(model=merged_module(pm.model_parts), optimizer=optimizer, tied=pm.tied_names)
    frozen = frozen_names(pm)  # LoRA's base: from model.path, train.init_from or the seed again, not the checkpoint
    lora = getattr(cfg.model, "lora", None)
    skip = frozen if lora is not None and lora.enabled and not lora.save_base else set()

    start = 0
    if path := resolve_resume(t.checkpoint.resume, t.checkpoint.dir):
        check_model_config(path, read_extra(path)["model_config"], cfg.model.model_dump(mode="json"))
        extra = load_checkpoint(path, **ckpt_kwargs, may_lack=frozen)
        if "fingerprints" in extra:  # what the saving mesh held, checked on this one before step 1
            check_fingerprints(pm, extra["fingerprints"], what=f"train.checkpoint.resume ({path})")
        start = int(extra["step"])
        scheduler.load_state_dict(extra["scheduler"])
        loader.load_state_dict(extra["loader"])
        _set_rng_state(extra["rng"])
        progress.log(f"resumed from {path} at step {start}")
        tracker.set_tag("resumed_from", str(path))
    result.first_step = start

    tokens_per_step = result.tokens_per_step = t.global_batch_size * t.seq_len
    window = LogWindow()
    memory_rows: list[dict] = []  # per-rank peaks at each logged step: an artifact, the metric is their max
    recorder = TimelineRecorder(pm)  # the last timeline_steps steps: start-up is not in the picture
    record_from = t.steps - cfg.tracking.timeline_steps + 1 if cfg.tracking.pictures else t.steps + 1
    if val_source is not None and _eval_at_start(cfg, resumed=start > 0):  # a baseline before any update
        _log_val(evaluate(pm, val_source, cfg, eval_loss_fn, device), start, cfg, tracker, progress)
    progress.start(total=t.steps, completed=start, every_s=t.progress_every_s)
    for step in range(start + 1, t.steps + 1):
        began = time.perf_counter()
        with recorder.step(step, record=step >= record_from):
            local_loss = local_aux = load = None
            _count_targets(eval_loss_fn, loader, t.global_batch_size)  # the step's (every accumulation batch's)
            for _ in range(t.grad_accum):
                inputs, targets, positions = _on(device, loader.next_batch())
                loss = pm.forward_backward(inputs, targets, loss_fn, loss_scale=1.0 / t.grad_accum, positions=positions)
                if loss is not None:
                    local_loss = loss / t.grad_accum if local_loss is None else local_loss + loss / t.grad_accum
                if isinstance(loss_fn, WithAuxLoss):  # this rank's share of the balance loss (every rank has one)
                    aux, rows = loss_fn.take()
                    local_aux = aux / t.grad_accum if local_aux is None else local_aux + aux / t.grad_accum
                    if rows is not None:
                        load = rows if load is None else load + rows
            with recorder.mark("optimizer"):
                grad_norm = pm.clip_grad_norm_(t.grad_clip)
                lr = scheduler.get_last_lr()[0]
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad(set_to_none=True)
        loss_value = pm.reduce_loss(local_loss)
        step_time = time.perf_counter() - began
        result.losses.append(loss_value)
        result.step_times.append(step_time)
        result.grad_norms.append(float(grad_norm))
        figures = {"loss": loss_value, "grad_norm": grad_norm, "step_time_s": step_time}
        if local_aux is not None:  # the balance loss, unweighted: its own metric (the loss includes it, weighted)
            figures["aux_loss"] = pm.reduce_loss(local_aux)
            result.aux_losses.append(figures["aux_loss"])
            if load is None:  # a pipeline rank whose stages hold no MoE block still joins the sum
                load = torch.zeros(cfg.model.moe.num_experts, dtype=torch.float64, device=device)
            figures.update(expert_load(_summed(load, pm)))
        window.add(step, **figures)

        if step % t.log_every == 0 or step == t.steps:
            peaks = _per_rank(meter.peak_mb(), pm, device)
            memory_rows.append({"step": step, **{f"rank{r}": round(v, 1) for r, v in enumerate(peaks)}})
            first = window.first_step
            metrics = {**window.means(tokens_per_step), "lr": lr, "peak_memory_mb": max(peaks)}
            tracker.log_metrics(metrics, step=step)
            progress.log_step(step, metrics, first=first)
            result.last_window, result.peak_memory_mb = {"first": first, "last": step, **metrics}, max(peaks)
        progress.advance(step, loss=loss_value, tokens_per_s=tokens_per_step / step_time, tokens=tokens_per_step,
                         step_time_s=step_time)
        if val_source is not None and ((t.eval_every and step % t.eval_every == 0) or step == t.steps):
            result.val_loss = evaluate(pm, val_source, cfg, eval_loss_fn, device)
            _log_val(result.val_loss, step, cfg, tracker, progress)

        ckpt = t.checkpoint
        if (ckpt.every and step % ckpt.every == 0) or (ckpt.save_final and step == t.steps):
            began_save = time.perf_counter()
            extra = {"step": step, "scheduler": scheduler.state_dict(), "loader": loader.state_dict(),
                     "rng": _rng_state(), "model_config": cfg.model.model_dump(mode="json"),
                     "data_config": cfg.data.model_dump(mode="json"), "fingerprints": model_fingerprints(pm),
                     "base": {"seed": t.seed, "init_from": t.init_from}}  # where frozen weights left out come from
            with naming_a_full_disk(ckpt.dir, needed_bytes=state_bytes(ckpt_kwargs["model"], optimizer)):
                saved = save_checkpoint(ckpt.dir, step, extra=extra, keep=ckpt.keep, skip=skip, **ckpt_kwargs)
            seconds = time.perf_counter() - began_save
            if rank == 0:
                nbytes = checkpoint_bytes(saved)["total"]
                figures = {"checkpoint_seconds": seconds, "checkpoint_bytes": nbytes}
                if ckpt.every:  # periodic saves: a chart; the final save alone: one number of the run
                    tracker.log_metrics(figures, step=step)
                else:
                    tracker.log_summary(figures)
                tracker.set_tag("latest_checkpoint", str(saved.resolve()))
                progress.log(f"checkpoint {saved} ({nbytes / 2**20:.1f} MiB, {seconds:.2f} s)")
            result.last_checkpoint = str(saved.resolve())
    if cfg.tracking.pictures:  # a collective: every rank gathers its actions to rank 0, which draws them
        result.pictures = timeline_pictures(recorder, cfg, tracker=tracker, progress=progress, out_dir=pictures_dir)
    progress.stop()
    if memory_rows:
        tracker.log_artifact_text(json.dumps(memory_rows, indent=1), "metrics/peak_memory_mb_per_rank.json")
        last = memory_rows[-1]  # the console too: one line per run, each rank's figure beside the plan's prediction
        progress.log("memory: measured peak per rank " + ", ".join(
            f"{v:,.0f}" for k, v in last.items() if k.startswith("rank")) + f" MiB (step {last['step']})")
    return result


class LogWindow:
    """The steps since the last logged one: metrics are logged as their means over the window (a
    chart point stands for every step it covers, not one sample every ``log_every`` steps), and
    the console's step line says which steps (:func:`trainer.run.metrics.format_metrics`)."""

    def __init__(self) -> None:
        self._values: dict[str, list[float]] = {}
        self.first_step: int | None = None  # the window's first step

    def add(self, step: int, **values: float) -> None:
        if not self._values:
            self.first_step = step
        for key, value in values.items():
            self._values.setdefault(key, []).append(float(value))

    def means(self, tokens_per_step: int) -> dict[str, float]:
        """Means of the window's values, ``tokens_per_s`` over its total time; empties the window."""
        out = {key: sum(v) / len(v) for key, v in self._values.items()}
        out["tokens_per_s"] = tokens_per_step * len(self._values["step_time_s"]) / sum(self._values["step_time_s"])
        self._values = {}
        return out


def evaluate(pm: ParallelModel, val_source: Source, cfg: RunConfig, loss_fn, device: torch.device) -> float:
    """The mean loss over ``train.eval_batches`` validation batches: the same sequences every
    time (a fresh loader at position 0), split over the dp ranks as training batches are."""
    t = cfg.train
    loader = GlobalBatchLoader(val_source, global_batch_size=t.global_batch_size // t.grad_accum,
                               dp_rank=pm.dp_rank, dp_size=pm.dp_size, seed=t.seed, cp_rank=pm.cp_rank,
                               cp_size=pm.cp_size)
    pm.train(False)
    try:
        losses = []
        for _ in range(t.eval_batches):
            _count_targets(loss_fn, loader, loader.global_batch_size)
            inputs, targets, positions = _on(device, loader.next_batch())
            losses.append(pm.reduce_loss(pm.evaluate(inputs, targets, loss_fn, positions)))
    finally:
        pm.train(True)
    return sum(losses) / len(losses)


def _count_targets(loss_fn, loader: GlobalBatchLoader, samples: int) -> None:
    """Give a :class:`TargetMeanLoss` the mean target count per row of the next ``samples`` global
    samples (a no-op for other losses: every target counts). With context parallelism a rank holds
    1 / cp of each row: the count per rank's share of a row, so that the mean of the ranks' losses
    is the sum over every target of the full rows divided once by their count."""
    if isinstance(loss_fn, TargetMeanLoss):
        loss_fn.tokens_per_row = max(1, loader.target_tokens(samples)) / samples / loader.cp_size


def _on(device: torch.device, batch: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``(inputs, targets, positions or None)`` of a loader batch, on ``device``."""
    inputs, targets, *rest = (x.to(device) for x in batch)
    return inputs, targets, (rest[0] if rest else None)


def _eval_at_start(cfg: RunConfig, *, resumed: bool) -> bool:
    """``train.eval_at_start``, or when null: weights were loaded (a Hugging Face directory's
    safetensors, ``train.init_from``) and the run starts fresh (a resumed run's first run evaluated)."""
    if cfg.train.eval_at_start is not None:
        return cfg.train.eval_at_start
    loaded = bool(cfg.train.init_from) or (isinstance(cfg.model, HFModelConfig) and bool(weight_files(cfg.model.path)))
    return loaded and not resumed


def _log_val(val_loss: float, step: int, cfg: RunConfig, tracker: Tracker, progress: Progress) -> None:
    """``val_loss`` and ``val_perplexity`` to the tracker at ``step``, and a console line."""
    metrics = {"val_loss": val_loss, "val_perplexity": math.exp(min(val_loss, 700))}
    tracker.log_metrics(metrics, step=step)
    progress.log(f"step {step}/{cfg.train.steps} | val_loss {val_loss:.4f} | val_perplexity {metrics['val_perplexity']:.2f}")


def frozen_names(pm: ParallelModel) -> set[str]:
    """The canonical FQNs of this rank's parameters that do not train (LoRA's base weights)."""
    return {canonical_fqn(name) for part in pm.model_parts
            for name, p in part.named_parameters(remove_duplicate=False) if not p.requires_grad}


def _per_rank(value: float, pm: ParallelModel, device: torch.device) -> list[float]:
    """``value`` of every rank, in rank order (a collective: every rank calls it)."""
    if pm.mesh is None:
        return [value]
    import torch.distributed as dist

    mine = torch.tensor([value], dtype=torch.float64, device=device)
    everyone = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, mine)
    return [float(v) for v in everyone]


def expert_load(tokens_per_expert: torch.Tensor) -> dict[str, float]:
    """The step's rows per expert (summed over the batch, averaged over the MoE blocks) as metrics: the
    least and most loaded expert's, and the imbalance max / mean (1 = balanced)."""
    mean = float(tokens_per_expert.mean())
    return {"tokens_per_expert_min": float(tokens_per_expert.min()), "tokens_per_expert_max": float(tokens_per_expert.max()),
            "expert_imbalance": float(tokens_per_expert.max()) / mean if mean else 1.0}


def _summed(value: torch.Tensor, pm: ParallelModel) -> torch.Tensor:
    """``value`` summed over every rank (a collective): each rank routes its own rows of the batch through
    its own stages' blocks; the ranks that repeat them (tensor parallelism) count once."""
    if pm.mesh is None:
        return value
    import torch.distributed as dist

    total = value.clone()
    dist.all_reduce(total)
    return total / (pm.replicas // (pm.dp_size * pm.cp_size))


def _rng_state() -> dict:
    return {"torch": torch.get_rng_state(), "python": random.getstate()}


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    version, internal, gauss_next = state["python"]  # lists once stored as JSON; random wants tuples
    random.setstate((version, tuple(internal), gauss_next))
