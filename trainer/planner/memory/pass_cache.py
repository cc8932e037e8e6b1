"""The meta pass's answers, kept for the process: a pass is the costly part of a memory prediction
(a forward and backward of the model on the meta device, through torch's Python meta kernels: about
0.5 CPU-seconds for the default model, more for a bigger one), and validating many configs of one
model — a sweep's jobs, the control plane's submissions, a catalogue of bad configs — asks for the
same pass again and again under different layouts.

:func:`pass_key` names everything :func:`trainer.planner.memory.meta_pass.saved_activations` reads
(the model's config, the row, the precision, the micro-batch, each tp-local shape, the units and
blocks it counts in, the layouts that shard a norm's input, cp and ep); configs that agree on all
of it get the same answer. A Hugging Face model is also what its ``config.json`` says: its text is
part of the key.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path

from parallel.placements import placement_texts
from parallel.plan.spec import ParallelPlan
from parallel.plan.split import split_key
from trainer.config.schema import RunConfig


def pass_key(cfg: RunConfig, plan: ParallelPlan, micro_batch: int, attention: Callable) -> tuple | None:
    """What the meta pass of ``cfg`` under ``plan`` depends on; None when the model's files cannot be read."""
    files = ""
    if cfg.model.arch == "hf":
        if cfg.model.path is None:
            return None
        try:
            files = (Path(cfg.model.path) / "config.json").read_text()
        except (OSError, TypeError):
            return None
    texts, sizes = placement_texts(plan.placements), plan.mesh.axis_sizes  # the whole table in two questions
    placed = tuple(sorted((fqn, tuple(sorted((axis, text, sizes.get(axis, 1)) for axis, text in axes.items())))
                          for fqn, axes in texts.items()))
    sp_norms = tuple(sorted(name for name, layout in plan.layouts.items()
                            if any(p.is_shard for p in layout.input.values())))
    return (cfg.model.model_dump_json(), files, cfg.train.seq_len, cfg.train.precision, micro_batch, attention, placed,
            sp_norms, tuple(plan.units), tuple(plan.blocks), repr(plan.context_parallel), plan.cp_size,
            repr(plan.expert_parallel), plan.mesh.size(plan.expert_parallel.dim) if plan.expert_parallel else 1,
            cfg.train.loss_chunk_tokens, split_key(plan))  # the loss's chunks; a grid's or cube's split


class PassCache:
    """A bounded mapping ``pass_key -> saved_activations(...)``, safe for threads that validate at
    once (the control plane's pool); the oldest answer goes first."""

    def __init__(self, size: int = 64) -> None:
        self.size = size
        self._answers: OrderedDict[tuple, dict] = OrderedDict()
        self._lock = threading.Lock()

    def __contains__(self, key: tuple) -> bool:
        with self._lock:
            return key in self._answers

    def __getitem__(self, key: tuple) -> dict:
        with self._lock:
            self._answers.move_to_end(key)
            return self._answers[key]

    def __setitem__(self, key: tuple, saved: dict) -> None:
        with self._lock:
            self._answers[key] = saved
            while len(self._answers) > self.size:
                self._answers.popitem(last=False)


PASSES = PassCache()
