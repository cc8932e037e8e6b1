"""Progress display and resource metrics.

:class:`Progress` shows a rich progress bar (loss, tokens/s, ETA) on a terminal and plain
log lines otherwise (service logs, tests). :class:`NullProgress` is what ranks other than 0 get.
"""

from __future__ import annotations

import resource
import sys

import torch


def peak_memory_mb(device: torch.device) -> float:
    """Peak memory of this worker: max allocated on CUDA, peak RSS on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


class MemoryMeter:
    """The memory this worker's training used, comparable with the plan's prediction.

    CUDA: ``torch.cuda.max_memory_allocated`` (what the caching allocator handed out). CPU: the
    process's resident high-water mark (``VmHWM``) above its floor, the resident size when the meter
    was made (interpreter, torch, the data), with the high-water mark reset there when Linux
    allows it (``/proc/self/clear_refs``), so start-up does not count.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
            self.floor = 0.0
            return
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # resets VmHWM to the current resident size
        except OSError:
            pass
        self.floor = _proc_status_kib("VmRSS") or 0.0

    def peak_mb(self) -> float:
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device) / 2**20
        peak = _proc_status_kib("VmHWM")
        if peak is None:
            return peak_memory_mb(self.device)
        return max(0.0, peak - self.floor) / 1024


def _proc_status_kib(key: str) -> float | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return float(line.split()[1])
    except OSError:
        return None
    return None


def format_metrics(step: int, total: int, metrics: dict[str, float]) -> str:
    return (f"step {step}/{total} | loss {metrics['loss']:.4f} | lr {metrics['lr']:.2e} | "
            f"grad_norm {metrics['grad_norm']:.3f} | {metrics['tokens_per_s']:,.0f} tok/s | "
            f"{metrics['step_time_s'] * 1000:.0f} ms/step | peak {metrics['peak_memory_mb']:.0f} MiB")


class NullProgress:
    """Shows nothing (ranks other than 0)."""

    def start(self, total: int, completed: int = 0) -> None: ...
    def advance(self, step: int, **fields: float) -> None: ...
    def log_step(self, step: int, metrics: dict[str, float]) -> None: ...
    def log(self, message: str) -> None: ...
    def stop(self) -> None: ...


class Progress(NullProgress):
    """A progress bar with loss, tokens/s and ETA when stdout is a terminal; log lines always."""

    def __init__(self, *, live: bool | None = None):
        self.live = sys.stdout.isatty() if live is None else live
        self.total = 0
        self._bar = None

    def start(self, total: int, completed: int = 0) -> None:
        self.total = total
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

    def log_step(self, step: int, metrics: dict[str, float]) -> None:
        self.log(format_metrics(step, self.total, metrics))

    def log(self, message: str) -> None:
        if self._bar is not None:
            self._bar.console.print(message)
        else:
            print(message, flush=True)

    def stop(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None
