"""What the launcher records about a run: in MLflow when it starts, on the console when it ends.

    with system_metrics(cfg.tracking, tracker):
        pictures = record_start(tracker, cfg, dir) # tags, readable params, config.yaml, plan.txt, dataset
        outcome = ...train...
    upload_logs(tracker, log_dir)                  # logs/<rank>/stdout.log, ...
    print(summary(cfg, outcome, tracker, wall_s=..., log_dir=...))

Everything the config says goes through :func:`trainer.tracking.run_info.public_config` first, so no
tracking URI, URL password or token reaches a param, a tag or an artifact.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import sys
import threading
from collections.abc import Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import yaml

from parallel.plan.resolve import resolve_plan
from parallel.plan.serial import PlanMismatch, ResolvedPlan
from parallel.plan.spec import ParallelPlan
from trainer.config.schema import RunConfig, TrackingConfig
from trainer.models.skeleton import meta_model
from trainer.pictures.placement import write_placement
from trainer.planner.report import describe_plan
from trainer.tracking.credentials import connect_uri
from trainer.tracking.end_of_run import error_lines
from trainer.tracking.run_info import public_config, redact, run_tags, run_url, ui_command
from trainer.tracking.tracker import NullTracker, Tracker

log = logging.getLogger(__name__)


def record_start(tracker: Tracker, cfg: RunConfig, pictures_dir: Path, *, plan: ParallelPlan | None = None,
                 artifacts: Mapping[str, str] | None = None) -> Future[dict[str, str]]:
    """Tags, params, the resolved config and dry-run plan as artifacts (with ``artifacts``: more
    text artifacts by name, e.g. the auto-planner's ranking), the data as a dataset input, and
    (``tracking.pictures``) the placement picture written into ``pictures_dir`` and logged under
    ``pictures/``. All of it in threads, so that the workers start meanwhile: the writes wait for a run
    that is still being made (:mod:`trainer.tracking.opening`), the picture (matplotlib's import and
    drawing: 2-4 s on a small host) is drawn beside them. The future gives the pictures' paths by name
    once both are done, or raises what failed. ``plan``: the config's resolved plan (None: none could be
    resolved, no plan.txt nor picture)."""
    plan = plan if cfg.tracking.pictures or not isinstance(tracker, NullTracker) else None
    recording = ThreadPoolExecutor(max_workers=2, thread_name_prefix="run-record")
    pictures = recording.submit(_placement_pictures, tracker, cfg, plan, pictures_dir)
    record = recording.submit(_record_config, tracker, cfg, plan, artifacts or {}, pictures)
    recording.shutdown(wait=False)  # the threads end after their one task each
    return record


def _record_config(tracker: Tracker, cfg: RunConfig, plan: ParallelPlan | None, artifacts: Mapping[str, str],
                   pictures: Future[dict[str, str]]) -> dict[str, str]:
    """:func:`record_start`'s writes; then the pictures' paths, once drawn."""
    if not isinstance(tracker, NullTracker):
        tracker.set_tags(run_tags(cfg))
        public = public_config(cfg.model_dump(mode="json"))
        tracker.log_params(public)
        tracker.log_artifact_text(yaml.safe_dump(public, sort_keys=False), "config.yaml")
        if plan is not None:
            tracker.log_artifact_text(describe_plan(cfg, plan, pictures_dir=None), "plan.txt")
        for name, text in artifacts.items():
            tracker.log_artifact_text(text, name)
        tracker.log_dataset(*dataset_identity(cfg))
    return pictures.result()


def _placement_pictures(tracker: Tracker, cfg: RunConfig, plan, pictures_dir: Path) -> dict[str, str]:
    """The placement picture and table written and logged under ``pictures/``: their paths by name."""
    if plan is None or not cfg.tracking.pictures:
        return {}
    pictures = {}
    for kind, path in write_placement(cfg, plan, pictures_dir).items():
        tracker.log_artifact(path, "pictures")
        pictures[f"placement {'picture' if kind == 'png' else 'table'}"] = str(path)
    return pictures


def launch_plan(cfg: RunConfig, plan: ParallelPlan | ResolvedPlan | None = None) -> ResolvedPlan | None:
    """The config's resolved plan (what ``dry_run=true`` reports) with the fingerprint of the model it is for, as
    the launcher hands it to its workers: ``plan`` (validation's, in this process) as given; a stored one (the
    control plane's, resolved at submission) once this launcher's meta model is seen to be its model; else
    resolved here. None when the model cannot be planned on the meta device (a custom module that needs real
    tensors): the run trains anyway, each worker resolving its own."""
    try:
        model = meta_model(cfg.model)  # validation's, when it ran in this process
        if isinstance(plan, ResolvedPlan):
            if _fits(plan, model):
                return plan
            plan = None
        return ResolvedPlan.of(plan if plan is not None else resolve_plan(cfg.parallel, cfg.mesh, model), model)
    except Exception as err:  # noqa: BLE001 - the plan only describes the run
        log.warning("no plan.txt or placement picture for this run: %s: %s", type(err).__name__, err)
        return None


def _fits(stored: ResolvedPlan, model: Any) -> bool:
    """Whether ``stored`` was resolved for ``model``; if not (the model's files changed since), a warning."""
    try:
        stored.plan_for(model, source="the stored plan")
        return True
    except PlanMismatch as err:
        log.warning("resolving the plan again: %s", err)
        return False


def dataset_identity(cfg: RunConfig) -> tuple[str, str | None, str]:
    """``(name, source, digest)`` of the run's data: where it is read from (None when generated in
    code) and a digest of the data config, so runs on the same data share one dataset in MLflow."""
    data = cfg.data.model_dump(mode="json")
    digest = hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:16]
    source: str | None = None
    if cfg.data.kind == "text":
        root = cfg.data.root
        if root == "stdlib":
            import sysconfig

            root = sysconfig.get_paths()["stdlib"]
        source, name = str(Path(root).resolve()), f"text:{cfg.data.root}/{cfg.data.glob}"
    elif cfg.data.kind == "files" and cfg.data.paths:
        parts = Path(cfg.data.paths[0]).parts  # the folder above the first glob character
        literal = Path(*parts[: next((i for i, p in enumerate(parts) if any(c in p for c in "*?[")), len(parts))])
        source, name = str(literal.resolve()), f"files:{','.join(cfg.data.paths)}"
    else:
        name = f"{cfg.data.kind}:{digest}"
    return redact(name)[:500], source, digest


@contextmanager
def system_metrics(cfg: TrackingConfig, tracker: Tracker) -> Iterator[None]:
    """MLflow's own system-metrics monitor (CPU, memory, disk, network, GPU through pynvml) on this
    run while the block runs; at least one sample even when the run is shorter than the interval. The
    monitor starts in a thread once the run exists (it may still be being made: :mod:`trainer.tracking.opening`)."""
    if not cfg.system_metrics or isinstance(tracker, NullTracker):
        yield
        return
    monitors: list[Any] = []
    starting = threading.Thread(target=_start_monitor, args=(cfg, tracker, monitors), name="system-metrics",
                                daemon=True)
    starting.start()
    try:
        yield
    finally:
        starting.join()
        for monitor in monitors:
            try:
                if monitor._logging_step == 0:  # noqa: SLF001 - nothing published yet: a short run
                    monitor.collect_metrics()
                    monitor.publish_metrics(monitor.aggregate_metrics())
            except Exception:  # noqa: BLE001 - a missing sample must not fail the run
                log.warning("could not take a system-metrics sample", exc_info=True)
            monitor.finish()


def _start_monitor(cfg: TrackingConfig, tracker: Tracker, started: list[Any]) -> None:
    """MLflow's monitor on ``tracker``'s run, put in ``started``; nothing when the run was not made."""
    if (run_id := tracker.run_id) is None:
        return
    try:
        from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

        logging.getLogger("mlflow.system_metrics").setLevel(logging.WARNING)  # its start/stop notices are noise here
        monitor = SystemMetricsMonitor(run_id, sampling_interval=cfg.system_metrics_interval,
                                       tracking_uri=connect_uri(cfg.tracking_uri))
        monitor.start()
    except Exception:  # noqa: BLE001 - the run trains without its system metrics, and says so
        log.warning("no system metrics for this run: the monitor did not start", exc_info=True)
        return
    started.append(monitor)


def upload_logs(tracker: Tracker, log_dir: Path | None) -> None:
    """The workers' per-rank log files (torch elastic's layout: ``<attempt>/<rank>/stdout.log``) as
    the run's ``logs/`` artifacts. Best effort: the logs are also on disk."""
    if log_dir is None or not log_dir.is_dir() or isinstance(tracker, NullTracker):
        return
    for path in sorted(log_dir.rglob("*")):
        if path.is_file() and path.stat().st_size > 0:
            try:
                tracker.log_artifact(path, str(Path("logs") / path.parent.relative_to(log_dir)))
            except Exception:  # noqa: BLE001
                log.warning("could not upload %s", path, exc_info=True)


def summary(cfg: RunConfig, outcome: dict[str, Any], tracker: Tracker, *, wall_s: float,
            log_dir: Path | None = None) -> str:
    """The end-of-run lines: steps and loss, wall time, best loss; tokens/s as the mean over the run
    (the first step left out) and the last step line's means (the same numbers it printed); where
    the MLflow run, the last checkpoint, the per-rank logs (real paths) and the pictures are."""
    losses, first = outcome.get("losses") or [], outcome.get("first_step", 0)
    if not losses:
        return f"done: no steps left to run (resumed at step {first})"
    val = outcome.get("val_loss")
    val_text = f", val loss {val:.4f} (perplexity {math.exp(min(val, 700)):.2f})" if val is not None else ""
    last = first + len(losses)
    lines = [f"done: steps {first + 1}..{last}, loss {losses[0]:.4f} -> {losses[-1]:.4f} (single steps){val_text}"]
    best = min(range(len(losses)), key=losses.__getitem__)
    lines.append(f"  wall time {wall_s:.1f} s | final loss {losses[-1]:.4f} | best {losses[best]:.4f} at step "
                 f"{first + best + 1}")
    lines.append("  " + " | ".join(_speeds(outcome, first, last)))
    url = run_url(cfg.tracking.tracking_uri, getattr(tracker, "experiment_id", None), tracker.run_id,
                  cfg.tracking.ui_url)
    if url:
        serve = ui_command(cfg.tracking.tracking_uri, cfg.tracking.ui_url)
        lines.append(f"  mlflow run: {url}" + (f"  (serve it: {serve})" if serve else ""))
    if outcome.get("last_checkpoint"):
        lines.append(f"  last checkpoint: {outcome['last_checkpoint']}")
    if log_dir is not None:
        lines += log_lines(log_dir)
    for name, path in sorted((outcome.get("pictures") or {}).items()):
        lines.append(f"  {name}: {path}")
    return "\n".join(lines + error_lines(outcome.get("end_of_run_errors") or []))


def _speeds(outcome: dict[str, Any], first: int, last: int) -> list[str]:
    """Tokens/s over the run, and the last step line's window (its mean loss and tokens/s, as printed)."""
    times = outcome.get("step_times") or []
    timed = times[1:] or times  # the first step pays for start-up and compilation
    start = first + 1 + (len(times) > 1)
    speed = f"{outcome['tokens_per_step'] * len(timed) / sum(timed):,.0f}" if timed and sum(timed) else "n/a"
    out = [f"mean {speed} tok/s over " + (f"steps {start}-{last}" if start < last else f"step {last}")
           + (f" (step {first + 1} left out: start-up)" if len(times) > 1 else "")]
    window = outcome.get("last_window") or {}
    if window and window.get("first") is not None:
        steps = (f"steps {window['first']}-{window['last']}" if window["first"] < window["last"]
                 else f"step {window['last']}")
        out.append(f"last step line ({steps}): loss {window['loss']:.4f}, {window['tokens_per_s']:,.0f} tok/s")
    return out


def log_lines(log_dir: Path) -> list[str]:
    """Where the per-rank logs are, as paths that exist: the last attempt's folder, its rank folders
    and their files, and rank 0's stdout (torch elastic's ``attempt_<n>/<rank>/`` layout)."""
    attempts = sorted((d for d in log_dir.glob("attempt_*") if d.name.removeprefix("attempt_").isdigit()),
                      key=lambda d: int(d.name.removeprefix("attempt_")))
    if not attempts:
        return [f"  logs: {log_dir}"]
    ranks = sorted((d for d in attempts[-1].iterdir() if d.is_dir() and d.name.isdigit()), key=lambda d: int(d.name))
    if not ranks:
        return [f"  logs: {attempts[-1]}"]
    files = sorted(set.intersection(*({f.name for f in d.iterdir() if f.is_file()} for d in ranks)))
    first = ranks[0] / ("stdout.log" if "stdout.log" in files else (files or [""])[0])
    beside = [f for f in files if f != first.name]
    of = f" (the last of {len(attempts)} attempts)" if len(attempts) > 1 else ""
    if len(ranks) == 1:
        return [f"  log: {first}" + (f" ({', '.join(beside)} beside it)" if beside else "") + of]
    return [f"  logs: {attempts[-1]}/{of} holds a folder per rank, {ranks[0].name}..{ranks[-1].name}, each with "
            f"{', '.join(files)}; rank {ranks[0].name}: {first}"]


@contextmanager
def tee_output(path: Path) -> Iterator[None]:
    """Copy everything this thread prints (stdout and stderr) into ``path`` while the block runs:
    one device's job log, as torch elastic writes the workers'. Launches in threads of one process
    each copy their own thread's lines; a line another thread prints goes into every open log."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a", buffering=1) as file:
        me = threading.get_ident()
        with _TEES.lock:
            if not _TEES.files:  # the first open log puts the tees in place; the last one out takes them away
                _TEES.saved = sys.stdout, sys.stderr
                sys.stdout, sys.stderr = _Tee(sys.stdout), _Tee(sys.stderr)
            previous, _TEES.files[me] = _TEES.files.get(me), file
        try:
            yield
        finally:
            with _TEES.lock:
                if previous is None:
                    del _TEES.files[me]
                else:
                    _TEES.files[me] = previous
                if not _TEES.files:
                    sys.stdout, sys.stderr = _TEES.saved


class _OpenLogs:
    """The job logs open in this process, by the thread whose lines each copies, and the streams the
    tees went in front of."""

    def __init__(self) -> None:
        self.lock = threading.RLock()  # a log is closed only when no line is being written to it
        self.files: dict[int, Any] = {}
        self.saved: tuple[Any, Any] = (sys.stdout, sys.stderr)


_TEES = _OpenLogs()


class _Tee:
    """A text stream that writes to ``stream`` and to the thread's open log (every open log, for a
    thread without one); everything else is ``stream``'s."""

    def __init__(self, stream: Any) -> None:
        self._stream = stream

    def write(self, text: str) -> int:
        with _TEES.lock:
            own = _TEES.files.get(threading.get_ident())
            for file in [own] if own is not None else list(_TEES.files.values()):
                file.write(text)
        return self._stream.write(text)

    def flush(self) -> None:
        with _TEES.lock:
            for file in _TEES.files.values():
                file.flush()
        self._stream.flush()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)
