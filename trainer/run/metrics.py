"""Progress display and resource metrics.

:class:`Progress` shows a rich progress bar (loss, tokens/s, ETA) on a terminal and, otherwise
(service logs, pipes, tests), a plain ``progress:`` line every ``train.progress_every_s`` seconds;
step lines either way, whose numbers are means over the steps since the previous one and say so.
:class:`NullProgress` is what ranks other than 0 get. :class:`MemoryMeter` measures a job's peak.
"""

from __future__ import annotations

import ctypes
import gc
import math
import platform
import resource
import sys
import time

import torch


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
    means = (f"loss {metrics['loss']:.4f}, {aux}grad_norm {metrics['grad_norm']:.3f}, {metrics['tokens_per_s']:,.0f} tok/s, "
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

    def __init__(self, *, live: bool | None = None, clock=time.monotonic):
        self.live = sys.stdout.isatty() if live is None else live
        self.total = 0
        self.every_s = math.inf  # no plain progress lines until start() says how often
        self._clock = clock
        self._bar = None
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

        self._bar = RichProgress(
            TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(),
            TextColumn("loss {task.fields[loss]:.4f}"), TextColumn("{task.fields[tps]:,.0f} tok/s"),
            TextColumn("ETA"), TimeRemainingColumn(),
        )
        self._task = self._bar.add_task("train", total=total, completed=completed, loss=float("nan"), tps=0.0)
        self._bar.start()

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
