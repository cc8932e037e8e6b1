"""Progress display and resource metrics, and the loop's logging of them.

:class:`Progress` shows a rich progress bar (loss, tokens/s, ETA) on a terminal and, otherwise
(service logs, pipes, tests), a plain ``progress:`` line every ``train.progress_every_s`` seconds;
step lines either way, whose numbers are means over the steps since the previous one and say so.
:class:`NullProgress` is what ranks other than 0 get. :class:`MemoryMeter` measures a job's peak.
:class:`StepLog` is the loop's logging: each step's figures into a window, logged as its means.
"""

from __future__ import annotations

import ctypes
import gc
import json
import math
import platform
import resource
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from trainer.tracking.tracker import Tracker

if TYPE_CHECKING:  # rich is imported when a bar is shown (start-up)
    from rich.progress import Progress as RichProgress


def peak_memory_mb(device: torch.device) -> float:
    """Peak memory of this worker: max allocated on CUDA, peak RSS on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


class MemoryMeter:
    """The memory this worker's training used, comparable with the plan's prediction.

    CUDA: ``torch.cuda.max_memory_allocated`` since the meter was made (its peak statistics reset).
    CPU: the resident high-water mark (``VmHWM``, reset to the current resident size through
    ``/proc/self/clear_refs`` where Linux allows it) above the process's floor: its resident size
    when its first meter was made (interpreter, torch, the data), so start-up does not count.

    Several jobs in one process (a sweep's in-process jobs): the high-water mark is process-wide
    and an earlier job's freed heap stays resident, so the next job reuses those pages without
    growing, and a floor read at its own start measured 0-5 MiB for a 14 MiB job. So every meter
    first hands freed heap back to the system (``gc.collect`` and glibc's ``malloc_trim``), resets
    the mark there, and counts from the first job's floor: a later job's peak then holds what the
    process keeps for it (the runtime, as the first job's does) and what it grows, measured 14.4,
    14.4 and 17.8 MiB for the same job run first, second and after a 440 MiB one.
    """

    def __init__(self, device: torch.device) -> None:
        global _PROCESS_FLOOR_KIB
        self.device = device
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
            self.floor = 0.0
            return
        _release_freed_heap()
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # resets VmHWM to the current resident size
        except OSError:
            pass
        if _PROCESS_FLOOR_KIB is None:
            _PROCESS_FLOOR_KIB = _proc_status_kib("VmRSS") or 0.0
        self.floor = _PROCESS_FLOOR_KIB

    def peak_mb(self) -> float:
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device) / 2**20
        peak = _proc_status_kib("VmHWM")
        if peak is None:
            return peak_memory_mb(self.device)
        return max(0.0, peak - self.floor) / 1024


_PROCESS_FLOOR_KIB: float | None = None  # resident KiB when this process's first meter was made


def _release_freed_heap() -> None:
    """Return freed memory to the system: unreachable objects, then glibc's free heap pages."""
    gc.collect()
    if platform.libc_ver()[0] == "glibc":
        ctypes.CDLL(None).malloc_trim(0)


def _proc_status_kib(key: str) -> float | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return float(line.split()[1])
    except OSError:
        return None
    return None


def format_metrics(step: int, total: int, metrics: dict[str, float], first: int | None = None) -> str:
    """A console step line. ``first``: the first step of the window the means cover (the steps since the
    previous line), named on the line when it spans more than this step."""
    aux = f"aux_loss {metrics['aux_loss']:.4f}, " if "aux_loss" in metrics else ""  # an MoE model's balance loss
    means = (f"loss {metrics['loss']:.4f}, {aux}grad_norm {metrics['grad_norm']:.3f}, "
             f"{metrics['tokens_per_s']:,.0f} tok/s, "
             f"{metrics['step_time_s'] * 1000:.0f} ms/step")
    return (f"step {step}/{total} | {_window_label(first, step)}{means} | lr {metrics['lr']:.2e} | "
            f"peak {metrics['peak_memory_mb']:.0f} MiB")


def _window_label(first: int | None, last: int) -> str:
    return f"mean of steps {first}-{last}: " if first is not None and first < last else ""


def format_eta(seconds: float) -> str:
    """``45s``, ``12m05s``, ``3h07m``."""
    seconds = max(0, round(seconds))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


class NullProgress:
    """Shows nothing (ranks other than 0)."""

    def start(self, total: int, completed: int = 0, every_s: float | None = None) -> None: ...
    def advance(self, step: int, **fields: float) -> None: ...
    def log_step(self, step: int, metrics: dict[str, float], first: int | None = None) -> None: ...
    def log(self, message: str) -> None: ...
    def stop(self) -> None: ...


class Progress(NullProgress):
    """A progress bar with loss, tokens/s and ETA when stdout is a terminal; otherwise a plain
    ``progress:`` line when ``every_s`` seconds (``train.progress_every_s``) passed since the last
    console line. Log lines always.

    ``advance`` takes the step's ``loss``, ``tokens_per_s``, and (for the plain line) ``tokens`` and
    ``step_time_s``: the plain line's loss and tok/s are means over the steps since the last line,
    as a step line's are; its eta is the steps left times the mean step time so far (the run's
    first step left out: start-up)."""

    def __init__(self, *, live: bool | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.live = sys.stdout.isatty() if live is None else live
        self.total = 0
        self.every_s = math.inf  # no plain progress lines until start() says how often
        self._clock = clock
        self._bar: RichProgress | None = None
        self._window: list[tuple[int, float, float, float]] = []  # (step, loss, tokens, seconds) since the last line
        self._step_times: list[float] = []
        self._last_line = clock()
        self._logged_step: int | None = None

    def start(self, total: int, completed: int = 0, every_s: float | None = None) -> None:
        self.total = total
        if every_s is not None:
            self.every_s = every_s
        self._last_line = self._clock()
        if not self.live:
            return
        from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeRemainingColumn
        from rich.progress import Progress as RichProgress

        self._bar = bar = RichProgress(
            TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(),
            TextColumn("loss {task.fields[loss]:.4f}"), TextColumn("{task.fields[tps]:,.0f} tok/s"),
            TextColumn("ETA"), TimeRemainingColumn(),
        )
        self._task = bar.add_task("train", total=total, completed=completed, loss=float("nan"), tps=0.0)
        bar.start()

    def advance(self, step: int, **fields: float) -> None:
        if self._bar is not None:
            self._bar.update(self._task, completed=step, loss=fields.get("loss", float("nan")),
                             tps=fields.get("tokens_per_s", 0.0))
            return
        if "step_time_s" not in fields:
            return
        self._step_times.append(fields["step_time_s"])
        self._window.append((step, fields.get("loss", float("nan")), fields.get("tokens", 0.0), fields["step_time_s"]))
        if step == self._logged_step:  # its step line was just printed
            self._window = []
        elif step < self.total and self._clock() - self._last_line >= self.every_s:
            self.log(self.progress_line(step))

    def progress_line(self, step: int) -> str:
        """``progress: 7/25 steps (28%), eta 1m10s | mean of steps 5-7: loss 4.1234, 230 tok/s``."""
        steps, losses, tokens, seconds = zip(*self._window)
        timed = self._step_times[1:] or self._step_times
        eta = format_eta((self.total - step) * sum(timed) / len(timed))
        speed = sum(tokens) / sum(seconds) if sum(seconds) > 0 else 0.0
        label = _window_label(steps[0], step) or f"step {step}: "
        return (f"progress: {step}/{self.total} steps ({100 * step // self.total}%), eta {eta} | "
                f"{label}loss {sum(losses) / len(losses):.4f}, {speed:,.0f} tok/s")

    def log_step(self, step: int, metrics: dict[str, float], first: int | None = None) -> None:
        self._logged_step = step
        self.log(format_metrics(step, self.total, metrics, first))

    def log(self, message: str) -> None:
        self._last_line = self._clock()
        self._window = []
        if self._bar is not None:
            self._bar.console.print(message)
        else:
            print(message, flush=True)

    def stop(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None


class LogWindow:
    """The steps since the last logged one: metrics are logged as their means over the window (a
    chart point stands for every step it covers, not one sample every ``log_every`` steps), and
    the console's step line says which steps (:func:`format_metrics`)."""

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


class StepLog:
    """The loop's logging: every step's figures into a :class:`LogWindow`, logged (the tracker's
    metrics, the console's step line) as the window's means every ``log_every`` steps and at the
    last step, beside the ranks' peak memory; the progress display advanced every step; at the end,
    the per-rank peaks as an artifact and one console line.

    ``peaks_of_ranks(mine)``: every rank's peak in rank order (a collective: every rank logs)."""

    def __init__(self, *, total_steps: int, log_every: int, tokens_per_step: int, tracker: Tracker,
                 progress: NullProgress, meter: MemoryMeter, peaks_of_ranks: Callable[[float], list[float]]) -> None:
        self.total_steps, self.log_every, self.tokens_per_step = total_steps, log_every, tokens_per_step
        self.tracker, self.progress, self.meter, self.peaks_of_ranks = tracker, progress, meter, peaks_of_ranks
        self.window = LogWindow()
        self.memory_rows: list[dict] = []  # per-rank peaks at each logged step: an artifact, the metric is their max
        self.last_window: dict[str, Any] = {}  # the last step line's: first, last step and its means
        self.peak_memory_mb: float | None = None  # the largest rank's peak at the last logged step

    def record(self, step: int, stats: Any) -> None:
        """Add a step's :class:`~trainer.run.step.StepStats`; log the window when ``step`` is due."""
        self.window.add(step, **stats.figures())
        if step % self.log_every == 0 or step == self.total_steps:
            peaks = self.peaks_of_ranks(self.meter.peak_mb())
            self.memory_rows.append({"step": step, **{f"rank{r}": round(v, 1) for r, v in enumerate(peaks)}})
            first = self.window.first_step
            metrics = {**self.window.means(self.tokens_per_step), "lr": stats.lr, "peak_memory_mb": max(peaks)}
            self.tracker.log_metrics(metrics, step=step)
            self.progress.log_step(step, metrics, first=first)
            self.last_window, self.peak_memory_mb = {"first": first, "last": step, **metrics}, max(peaks)
        self.progress.advance(step, loss=stats.loss, tokens_per_s=self.tokens_per_step / stats.seconds,
                              tokens=self.tokens_per_step, step_time_s=stats.seconds)

    def finish(self) -> None:
        """The per-rank peaks as the run's artifact, and the last ones on the console beside the plan's prediction."""
        if not self.memory_rows:
            return
        self.tracker.log_artifact_text(json.dumps(self.memory_rows, indent=1), "metrics/peak_memory_mb_per_rank.json")
        last = self.memory_rows[-1]  # one line per run: each rank's figure
        self.progress.log("memory: measured peak per rank " + ", ".join(
            f"{v:,.0f}" for k, v in last.items() if k.startswith("rank")) + f" MiB (step {last['step']})")
