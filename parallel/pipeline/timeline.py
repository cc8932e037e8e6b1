"""Which actions this rank executed during a training step, and when: the measured pipeline timeline.

    recorder = TimelineRecorder(pm)
    for step in range(1, steps + 1):
        with recorder.step(step, record=step > steps - 2):       # the last two steps
            loss = pm.forward_backward(inputs, targets, loss_fn)
            with recorder.mark("optimizer"):
                optimizer.step(); optimizer.zero_grad()
    recorder.events   # [{"rank": 0, "name": "0F1", "kind": "F", "stage": 0, "microbatch": 1,
                      #   "start_us": ..., "end_us": ..., "step": 4, "peer": None, "wait_us": None}, ...]

With a pipeline, the torch schedule's stages (``pm.schedule``) have their ``forward_one_chunk``,
``backward_one_chunk`` (B, or I when the schedule splits the backward) and
``backward_weight_one_chunk`` (W) timed, and the loss on the last stage (LOSS). Those methods
are what every torch schedule (GPipe, 1F1B, the interleaved and zero-bubble ones) calls for each
action of its ``pipeline_order``, so one wrapping serves all of them; torch has no hook per action
(only profiler ranges, which differ between schedules and need the profiler running).

Communication: a stage's ``get_{fwd,bwd}_{send,recv}_ops`` make the point-to-point ops of one
action (SEND_F, RECV_F, SEND_B, RECV_B of a micro-batch); the schedules post them through
``_batch_p2p`` and wait through ``_wait_batch_p2p`` of ``torch.distributed.pipelining.schedules``,
so the ops are tagged when made and timed from posting (``start_us``) to the end of the wait that
completed them (``end_us``; ``wait_us``: how long that wait blocked). Those two are module
functions, so they are replaced for the whole process while a step records, and put back after.
Without a pipeline (one device, dp, fsdp, tp) ``pm.forward_backward`` is timed as one
``forward_backward`` action (kind FB), so every run has a timeline.

Nothing is wrapped outside a recorded step: ``step(record=False)`` and ``mark`` outside a
recorded step cost one attribute test. Times come from ``time.monotonic_ns``: CLOCK_MONOTONIC is
one system-wide clock on Linux, so the ranks of one host line up exactly and no rank's clock
jumps with NTP; it is not comparable across hosts, which is why :meth:`TimelineRecorder.clock`
gives each rank's offset to the wall clock for lining hosts up. On a GPU the device is
synchronised around each timed compute action while recording, so those times are the kernels',
not their launches'; a send's or receive's are what the host sees (NCCL's waits only order the
streams), so there the compute row is the one to read.
"""

from __future__ import annotations

import contextlib
import socket
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from parallel.pipeline.order import action_name

_GETTERS = {"get_fwd_send_ops": "SEND_F", "get_fwd_recv_ops": "RECV_F",
            "get_bwd_send_ops": "SEND_B", "get_bwd_recv_ops": "RECV_B"}
MARK_KINDS = {"optimizer": "OPT", "forward_backward": "FB"}


def _now_us() -> float:
    return time.monotonic_ns() / 1000.0


def pipeline_stages(schedule: Any) -> list[Any]:
    """The ``PipelineStage`` objects a torch schedule runs: ``_stages`` of the multi-stage
    schedules, ``_stage`` of GPipe and 1F1B (torch keeps both private)."""
    return list(getattr(schedule, "_stages", None) or [schedule._stage])


class TimelineRecorder:
    """Records this rank's executed actions with start and end times during chosen steps.

    Args:
        pm: the :class:`~parallel.engine.ParallelModel` whose steps are recorded.
        rank: the rank written into each event (default: the global rank, 0 without a group).

    ``events`` holds one dict per action: ``rank, name, kind, stage, microbatch, start_us,
    end_us, step, peer, wait_us`` (``peer``: the other rank of a send or receive; ``wait_us``: how
    long its wait blocked). Kinds: F, B, I, W, LOSS, SEND_F, RECV_F, SEND_B, RECV_B, FB, OPT.
    """

    def __init__(self, pm: Any, *, rank: int | None = None) -> None:
        self._pm = pm
        self.rank = rank if rank is not None else (dist.get_rank() if dist.is_available() and dist.is_initialized()
                                                   else 0)
        self.events: list[dict[str, Any]] = []
        self._step: int | None = None
        self._undo: list[Callable[[], None]] = []
        # id(op) -> (op, tag): the op is held so its id stays its own.
        self._tags: dict[int, tuple[Any, tuple[Any, ...]]] = {}
        # id(works) -> (works, tags, posted at).
        self._posted: dict[int, tuple[list[Any], list[tuple[Any, ...]], float]] = {}
        first = next(iter(pm.parameters()), None)
        self._cuda = first is not None and first.device.type == "cuda"

    def __repr__(self) -> str:
        return f"TimelineRecorder(rank={self.rank}, events={len(self.events)}, recording={self.recording})"

    @property
    def recording(self) -> bool:
        return self._step is not None

    def clock(self) -> dict[str, Any]:
        """This rank's host and the wall clock minus the monotonic clock (µs), the smallest of a
        few samples' brackets so that a context switch between the two reads cannot skew it."""
        best = None
        for _ in range(5):
            before = time.monotonic_ns()
            wall = time.time_ns()
            after = time.monotonic_ns()
            if best is None or after - before < best[0]:
                best = (after - before, (wall - (before + after) / 2) / 1000.0)
        assert best is not None, "the first sample is the best so far"
        return {"host": socket.gethostname(), "wall_minus_monotonic_us": best[1]}

    # -- recording -----------------------------------------------------------------

    @contextlib.contextmanager
    def step(self, step: int, *, record: bool = True) -> Iterator[None]:
        """Record the actions run inside the block as step ``step`` (nothing when ``record`` is false)."""
        if not record:
            yield
            return
        if self.recording:
            raise RuntimeError(f"step {step} begins while step {self._step} is recording")
        self._step = step
        try:
            self._install()
            yield
        finally:
            for undo in reversed(self._undo):
                undo()
            self._undo.clear()
            self._tags.clear()
            self._posted.clear()
            self._step = None

    @contextlib.contextmanager
    def mark(self, name: str, kind: str | None = None) -> Iterator[None]:
        """Record the block as one action ``name`` (kind ``MARK_KINDS[name]``, else ``name``
        upper-cased) when a step is recording; otherwise just run it."""
        if not self.recording:
            yield
            return
        start = self._stamp()
        yield
        self._add(name, kind or MARK_KINDS.get(name, name.upper()), None, None, start, self._stamp())

    def _stamp(self) -> float:
        if self._cuda:
            torch.cuda.synchronize()
        return _now_us()

    def _add(self, name: str, kind: str, stage: int | None, microbatch: int | None, start: float, end: float,
             *, peer: int | None = None, wait_us: float | None = None) -> None:
        self.events.append({"rank": self.rank, "name": name, "kind": kind, "stage": stage, "microbatch": microbatch,
                            "start_us": start, "end_us": end, "step": self._step, "peer": peer, "wait_us": wait_us})

    # -- wrapping ------------------------------------------------------------------

    def _patch(self, owner: Any, attr: str, replacement: Callable[..., Any]) -> None:
        """Set ``owner.attr`` for this step; the undo restores exactly what was there (an
        instance falls back to its class's method again)."""
        own = vars(owner).get(attr, _MISSING) if hasattr(owner, "__dict__") else _MISSING
        setattr(owner, attr, replacement)
        self._undo.append(lambda: delattr(owner, attr) if own is _MISSING else setattr(owner, attr, own))

    def _install(self) -> None:
        schedule = self._pm.schedule
        if schedule is None:  # no pipeline: the whole forward and backward is one action
            self._patch(self._pm, "forward_backward", self._timed(self._pm.forward_backward, _whole))
            return
        for stage in pipeline_stages(schedule):
            index = stage.stage_index
            self._patch(stage, "forward_one_chunk", self._timed(stage.forward_one_chunk, _chunk("F", index)))
            self._patch(stage, "backward_one_chunk", self._timed(stage.backward_one_chunk, _backward(index)))
            self._patch(stage, "backward_weight_one_chunk",
                        self._timed(stage.backward_weight_one_chunk, _chunk("W", index)))
            for getter, kind in _GETTERS.items():
                self._patch(stage, getter, self._tagging(getattr(stage, getter), kind, index))
        self._patch(schedule, "_maybe_compute_loss", self._timed(schedule._maybe_compute_loss, _loss))
        from torch.distributed.pipelining import schedules

        self._patch(schedules, "_batch_p2p", self._posting(schedules._batch_p2p))
        self._patch(schedules, "_wait_batch_p2p", self._waiting(schedules._wait_batch_p2p))

    def _timed(self, fn: Callable[..., Any], describe: Callable[..., Action | None]) -> Callable[..., Any]:
        """``fn`` timed as the action ``describe(*args)`` names (``(kind, stage, mb)``; None: untimed)."""

        def timed(*args: Any, **kwargs: Any) -> Any:
            what = describe(*args, **kwargs)
            if what is None:
                return fn(*args, **kwargs)
            start = self._stamp()
            result = fn(*args, **kwargs)
            kind, stage, mb = what
            name = "forward_backward" if kind == "FB" or stage is None else action_name(stage, kind, mb)
            self._add(name, kind, stage, mb, start, self._stamp())
            return result

        return timed

    def _tagging(self, getter: Callable[..., Any], kind: str, stage: int) -> Callable[..., list[Any]]:
        def tag(chunk: int, *args: Any, **kwargs: Any) -> list[Any]:
            ops: list[Any] = getter(chunk, *args, **kwargs)
            for op in ops:
                self._tags[id(op)] = (op, (kind, stage, chunk, getattr(op, "peer", None)))
            return ops

        return tag

    def _posting(self, batch_p2p: Callable[..., Any]) -> Callable[..., list[Any]]:
        def post(p2p_ops: list[Any], *args: Any, **kwargs: Any) -> list[Any]:
            posted = _now_us()
            works: list[Any] = batch_p2p(p2p_ops, *args, **kwargs)
            tags = [self._tags.pop(id(op))[1] for op in p2p_ops if id(op) in self._tags]
            if works and tags:
                self._posted[id(works)] = (works, tags, posted)
            return works

        return post

    def _waiting(self, wait_batch_p2p: Callable[..., Any]) -> Callable[[list[Any]], None]:
        def wait(works: list[Any]) -> None:
            began = _now_us()
            wait_batch_p2p(works)
            entry = self._posted.get(id(works))
            if entry is None or entry[0] is not works:  # not ours, or already waited
                return
            del self._posted[id(works)]
            ended = _now_us()
            for kind, stage, mb, peer in entry[1]:
                self._add(action_name(stage, kind, mb), kind, stage, mb, entry[2], ended, peer=peer,
                          wait_us=ended - began)

        return wait


# What a wrapped call is, from its arguments: (kind, stage, micro-batch), or None for "not timed".
Action = tuple[str, int | None, int | None]


def _whole(*args: Any, **kwargs: Any) -> Action:
    return ("FB", None, None)


def _chunk(kind: str, stage: int) -> Callable[..., Action]:
    # forward_one_chunk(fwd_chunk_id, ...), backward_weight_one_chunk(bwd_chunk_id, ...)
    return lambda chunk, *args, **kwargs: (kind, stage, chunk)


def _backward(stage: int) -> Callable[..., Action]:
    # backward_one_chunk(bwd_chunk_id, loss=None, full_backward=True, last_backward=False):
    # a full backward is B; the input-gradient half of a split one (zero-bubble schedules) is I.
    def describe(chunk: int, *args: Any, **kwargs: Any) -> Action:
        full = kwargs.get("full_backward", args[1] if len(args) > 1 else True)
        return ("B" if full else "I", stage, chunk)

    return describe


def _loss(stage: Any, output: Any, targets: Any, chunk: int, *args: Any, **kwargs: Any) -> Action | None:
    # _maybe_compute_loss(stage, output, target_mbs, mb_index, ...) computes a loss on the last stage only.
    return ("LOSS", stage.stage_index, chunk) if stage.is_last else None


_MISSING = object()
