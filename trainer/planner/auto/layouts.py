"""The candidate layouts the auto-planner's search considers: every split of the ranks into dp (and
its modes; hsdp's on every replicate x shard split, beside ep too), pp (its schedules, stages per rank and
micro-batches), cp (long rows; with a pipeline or not), ep (a model with experts) and tp (with sequence parallelism
and without; 2-D and 2.5-D grids and 3-D cubes where the ranks make one), gradient accumulation where there is no
pipeline, with each activation checkpointing (full: every block or every n-th) and precision the knobs allow, as
:class:`~trainer.planner.auto.ranking.Candidate` sections: the layouts practitioners write, as they write them.
:class:`Layouts` is the base of :class:`~trainer.planner.auto.search.Search`, which sets what it reads: ``knobs``,
``base`` (the config), ``world``, ``model`` and ``decoder`` (the meta model and its decoder config) and ``pricing``.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

from torch import nn

from parallel.config import INTERLEAVED_SCHEDULES, AutoPlanConfig
from parallel.context import supports_context_parallel
from trainer.config.schema import RunConfig
from trainer.planner.auto.ranking import Candidate
from trainer.planner.calibration.probe import bf16_supported
from trainer.config.model_schema import LlamaConfig
from trainer.planner.forecast.pricing import HostPricing, ProfilePricing
from trainer.planner.memory.layout import on_cuda


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


class Layouts:
    """Enumerates the candidates (see the module docstring)."""

    # Set by the subclass (:class:`~trainer.planner.auto.search.Search`) before any layout is asked for.
    knobs: AutoPlanConfig
    base: RunConfig
    world: int
    model: nn.Module
    decoder: LlamaConfig | None
    pricing: HostPricing | ProfilePricing

    def layouts(self) -> Iterator[Candidate]:
        """Every candidate the knobs allow."""
        k, t = self.knobs, self.base.train
        tp_ok = k.tensor_parallel and hasattr(self.model, "parallel_plan")
        precisions = [p for p in (k.precisions or [t.precision]) if p == "fp32" or self._bf16()]
        acs = [(a, every) for a in k.activation_checkpointing if a == "none" or self.decoder is not None
               for every in (k.activation_checkpointing_every if a == "full" else [1])]
        for tp in (divisors(self.world) if tp_ok else [1]):
            for cp in self._cp_sizes(self.world // tp):
                # cp pairs with a pipeline (every stage holds its cp rank's chunks of each micro-batch's rows);
                # experts with cp are not searched (layouts with cp are dp x pp x cp x tp).
                for pp in (divisors(self.world // tp // cp) if k.pipeline else [1]):
                    for ep in (self._ep_sizes(self.world // tp // pp) if cp == 1 else [1]):
                        dp = self.world // tp // pp // cp // ep
                        for (dp_name, dp_section), (pp_name, pipeline, accum), sp, ac, precision in itertools.product(
                                self._dp_options(dp, ep), self._batch_splits(pp, dp * ep),
                                k.sequence_parallel if tp > 1 else [False], acs, precisions):
                            yield self._candidate(dp, dp_name, dp_section, pp, pp_name, pipeline, tp, ep, ac, precision,
                                                  cp=cp, sp=sp, accum=accum)
        if tp_ok:  # Colossal-AI's 2-D and 3-D tensor parallelism where the ranks make a square or a cube
            for side, dims, depth, dp_section in self._grids():
                splits = self._batch_splits(1, self.world // side ** len(dims))
                for (_, _, accum), ac, precision in itertools.product(splits, acs, precisions):
                    yield _grid_candidate(self.world, side, dims, depth, dp_section, ac, precision, accum)

    def _grids(self) -> Iterator[tuple[int, tuple[str, ...], int, dict | None]]:
        """``(side q, grid axes, depth d, data-parallel section)`` of each q x q grid (``parallel.grid_parallel``;
        with a depth d > 1 Tesseract's 2.5-D, d layers of grids) and q x q x q cube (``parallel.tensor_parallel_3d``)
        whose ranks divide the world, the rest data-parallel (a grid's with each of the knobs' ddp / fsdp, over dp
        x depth; a cube's with ddp: FSDP2 takes at most two placements). Whether the model splits over it,
        validation decides (a refused candidate is listed as invalid)."""
        modes = [m for m in self.knobs.data_parallel_modes if m in ("ddp", "fsdp")]
        for dims, allowed in ((("row", "col"), modes), (("ca", "cb", "cc"), [m for m in modes if m == "ddp"])):
            side = 2
            while side ** len(dims) <= self.world:
                batch_ranks = self.world // side ** len(dims)
                if self.world % side ** len(dims) == 0:
                    for depth in divisors(batch_ranks) if len(dims) == 2 else [1]:
                        dp = batch_ranks // depth
                        sections = [None] if dp == 1 else [{"dim": "dp", "mode": m} for m in allowed]
                        yield from ((side, dims, depth, section) for section in sections)
                side += 1

    def _batch_splits(self, pp: int, dp: int) -> Iterator[tuple[str, dict | None, int]]:
        """``(pipeline label, pipeline section, gradient-accumulation steps)``: each pipeline of
        :meth:`_pipelines`; without one, each count of micro-batches a data-parallel rank's batch is
        accumulated over (train.grad_accum as set when above 1)."""
        t = self.base.train
        if pp > 1 or t.grad_accum > 1:
            yield from ((name, section, t.grad_accum) for name, section in self._pipelines(pp, dp))
            return
        per_rank = t.global_batch_size // dp if t.global_batch_size % dp == 0 else 0
        counts = self.knobs.grad_accum or [m for m in divisors(per_rank) if m <= self.knobs.max_microbatches] or [1]
        for m in counts:
            yield "", None, m

    def _ep_sizes(self, ranks: int) -> list[int]:
        """Expert-parallel sizes: 1, and for a model with experts every divisor of ``ranks`` that splits
        its experts evenly (a dense model: 1 only)."""
        moe = self.decoder.moe if self.decoder is not None else None
        if moe is None or not self.knobs.expert_parallel or not hasattr(self.model, "expert_modules"):
            return [1]
        return [e for e in divisors(ranks) if moe.num_experts % e == 0]

    def _cp_sizes(self, ranks: int) -> list[int]:
        """The cp sizes to consider: 1, and from ``knobs.context_parallel_from`` tokens on every divisor of
        ``ranks`` that cuts the rows into ``2 x cp`` chunks, for a model whose attention takes a split sequence and
        a run that does not compile (``train.compile`` with cp is refused: :mod:`trainer.validate.context_checks`;
        each pipeline, dp and tp split of it would be a refused candidate)."""
        start, seq_len = self.knobs.context_parallel_from, self.base.train.seq_len
        if start is None or seq_len < start or self.base.train.compile or not supports_context_parallel(self.model):
            return [1]
        return [cp for cp in divisors(ranks) if seq_len % (2 * cp) == 0]

    def _bf16(self) -> bool:
        if isinstance(self.pricing, ProfilePricing):
            return "bf16" in self.pricing.profile.peak_tflops
        return bf16_supported(_device(self.base))

    def _dp_options(self, dp: int, ep: int = 1) -> Iterator[tuple[str, dict | None]]:
        if dp == 1:
            yield "", None
            return
        for mode in self.knobs.data_parallel_modes:
            if ep > 1 and mode == "ddp":  # experts over ep compose with sharded data parallelism (fsdp, zero2, hsdp)
                continue
            if mode == "hsdp":
                for replicate in divisors(dp)[1:-1]:
                    yield f"dp{replicate}x{dp // replicate}(hsdp)", {"dim": ["dp_replicate", "dp_shard"],
                                                                     "mode": "hsdp"}
            else:
                yield f"dp{dp}({mode})", {"dim": "dp", "mode": mode}

    def _pipelines(self, pp: int, dp: int) -> Iterator[tuple[str, dict | None]]:
        if pp == 1:
            yield "", None
            return
        t = self.base.train
        per_rank = t.global_batch_size // dp // t.grad_accum if t.global_batch_size % (dp * t.grad_accum) == 0 else 0
        counts = self.knobs.microbatches or [m for m in divisors(per_rank) if m <= self.knobs.max_microbatches] or [pp]
        for schedule in self.knobs.schedules:
            spr_options = self.knobs.stages_per_rank if schedule in INTERLEAVED_SCHEDULES else \
                [2] if schedule == "ZBV" else [1]
            for spr in spr_options:
                for m in counts:
                    name = f"pp{pp}({schedule}{f' v{spr}' if spr > 1 else ''}, m{m})"
                    yield name, {"dim": "pp", "schedule": schedule, "microbatches": m, "stages_per_rank": spr,
                                 "boundaries": "auto"}

    def _candidate(self, dp, dp_name, dp_section, pp, pp_name, pipeline, tp, ep, checkpointing, precision, cp=1,
                   sp=False, accum=1) -> Candidate:
        dims, mesh = [], []
        if dp_section is not None:
            sizes = [(a, s) for a, s in (zip(dp_section["dim"], _hsdp_sizes(dp_name)) if dp_section["mode"] == "hsdp"
                                         else [("dp", dp)])]
            dims += [a for a, _ in sizes]
            mesh += [s for _, s in sizes]
        if pipeline is not None:
            dims.append("pp")
            mesh.append(pp)
        if cp > 1:  # inside pp, beside tp (Megatron's and torchtitan's order): the ring's hops on the nearer links
            dims.append("cp")
            mesh.append(cp)
        if ep > 1:
            dims.append("ep")
            mesh.append(ep)
        if tp > 1:
            dims.append("tp")
            mesh.append(tp)
        ac, every = checkpointing  # the mode, and with full every n-th block
        parallel: dict[str, Any] = {"dims": dims or ["dp"], "activation_checkpointing": ac,
                                    "activation_checkpointing_every": every}
        if dp_section is not None:
            parallel["data_parallel"] = dp_section
        elif not dims:  # one rank: a dp axis of size 1 keeps the section ordinary
            parallel["data_parallel"] = {"dim": "dp", "mode": "ddp"}
        if pipeline is not None:
            parallel["pipeline"] = pipeline
        if ep > 1:
            parallel["expert_parallel"] = {"dim": "ep"}
        if tp > 1:
            parallel["tensor_parallel"] = {"dim": "tp", "plan": "megatron", "sequence_parallel": sp}
        if cp > 1:
            parallel["context_parallel"] = {"dim": "cp", "method": "ring"}
        label = " x ".join(p for p in (dp_name, pp_name, f"cp{cp}" if cp > 1 else "", f"ep{ep}" if ep > 1 else "",
                                       f"tp{tp}{'(sp)' if sp else ''}" if tp > 1 else "")
                           if p) or "one rank"
        label += (f", accum {accum}" if accum > 1 and pipeline is None else "")
        label += (f", AC {ac}" if ac != "none" else "") + (f" every {every}" if every > 1 else "")
        label += ", bf16" if precision == "bf16" else ""
        return Candidate(label=label, mesh=mesh or [1], parallel=parallel, precision=precision, grad_accum=accum)


def _grid_candidate(world: int, side: int, dims: tuple[str, ...], depth: int, dp_section: dict | None,
                    checkpointing: tuple[str, int], precision: str, accum: int) -> Candidate:
    """A candidate of :meth:`Layouts._grids`: the tp2d(_dp) / tp2p5d / tp3d(_dp) presets' sections at these sizes
    (2.5-D with data parallelism as docs/layouts.md writes it: dims [dp, depth, row, col])."""
    ac, every = checkpointing
    dp = world // side ** len(dims) // depth
    layers = ["depth"] if depth > 1 else []
    parallel: dict[str, Any] = {"dims": [*(["dp"] if dp_section else []), *layers, *dims],
                                "activation_checkpointing": ac, "activation_checkpointing_every": every}
    if dp_section is not None:
        parallel["data_parallel"] = dp_section
    if len(dims) == 2:
        parallel["grid_parallel"] = {"rows": dims[0], "cols": dims[1], **({"depth": "depth"} if layers else {})}
    else:
        parallel["tensor_parallel_3d"] = {"dims": list(dims)}
    shape = "x".join([str(side)] * len(dims))
    label = " x ".join(p for p in (f"dp{dp}({dp_section['mode']})" if dp_section else "",
                                   f"depth{depth}" if layers else "",
                                   f"{'grid' if len(dims) == 2 else 'cube'} {shape}") if p)
    label += (f", accum {accum}" if accum > 1 else "")
    label += (f", AC {ac}" if ac != "none" else "") + (f" every {every}" if every > 1 else "")
    label += ", bf16" if precision == "bf16" else ""
    return Candidate(label=label, mesh=[*([dp] if dp_section else []), *([depth] if layers else []),
                                        *[side] * len(dims)], parallel=parallel,
                     precision=precision, grad_accum=accum)


def _hsdp_sizes(label: str) -> list[int]:
    replicate, shard = label.removeprefix("dp").split("(")[0].split("x")
    return [int(replicate), int(shard)]


def _device(cfg: RunConfig):
    import torch

    return torch.device("cuda" if on_cuda(cfg) else "cpu")
