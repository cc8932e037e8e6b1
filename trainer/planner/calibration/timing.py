"""Timing on a shared host: every measured point repeats until it has run long enough to average
out the scheduler's noise, and a collective runs the same number of calls on every rank."""

from __future__ import annotations

import math
import time

import torch
import torch.distributed as dist

MIN_SECONDS = 0.15  # per measured point: enough repetitions to average out the scheduler's noise


def timed(fn, min_s: float = MIN_SECONDS, min_reps: int = 3) -> float:
    """Mean seconds of one call of ``fn`` (a warm-up call first)."""
    fn()
    reps, began = 0, time.perf_counter()
    while reps < min_reps or time.perf_counter() - began < min_s:
        fn()
        reps += 1
    return (time.perf_counter() - began) / reps


def timed_together(fn, min_s: float) -> float:
    """:func:`timed` for a collective: every rank runs the same number of calls (the most any
    rank wants), or some would wait forever for a peer that stopped."""
    fn()
    dist.barrier()
    began = time.perf_counter()
    fn()
    want = torch.tensor([max(3, math.ceil(min_s / max(time.perf_counter() - began, 1e-6)))])
    dist.all_reduce(want, op=dist.ReduceOp.MAX)
    dist.barrier()
    began = time.perf_counter()
    for _ in range(int(want)):
        fn()
    return (time.perf_counter() - began) / int(want)
