"""The orchestrator: one call turns a full, initialised model into this rank's share of it.

    plan = resolve_plan(cfg.parallel, cfg.mesh, model)        # globs matched, stages split
    pm = parallelize(model, plan, device=torch.device("cpu"))
    loss = pm.forward_backward(inputs, targets, loss_fn)     # this rank's dp share of the batch
    grad_norm = pm.clip_grad_norm_(1.0)
    optimizer.step(); optimizer.zero_grad()
    print(pm.reduce_loss(loss))                               # the global mean, on every rank

Order of application, as torchtitan does it: split into pipeline stages -> tensor parallel
(placements, layouts) -> activation checkpointing -> torch.compile per block (``compile=True``)
-> data parallel -> (a meta model only) allocate this rank's shards and initialise them. The
model is either built and initialised in full on every rank, or built on the ``meta`` device and
initialised after sharding (``parallelize(meta_model, plan, device=..., init=lambda part:
part.init_weights(seed))``); because the initial values depend only on (seed, FQN, shape), both
give every value of one device.

With one device (a plan whose mesh is ``(1,)``) there is no mesh and ``forward_backward`` is a
plain forward and backward, so the training loop is the same code for every mesh.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from parallel.config import SPLIT_BACKWARD_SCHEDULES, Precision
from parallel.mesh import axis_rank, build_mesh, submesh
from parallel.pipeline.schedule import build_schedule, split_stages
from parallel.pipeline.stage_io import attach_boundaries, lane_groups, stage_to_group_rank
from parallel.plan.spec import ParallelPlan, PipelineSpec
from parallel.sharding.activation_checkpointing import apply_ac
from parallel.sharding.compile import apply_compile
from parallel.sharding.data_parallel import apply_data_parallel
from parallel.sharding.tensor_parallel import apply_placements
from parallel.sharding.ties import retie, tied_groups

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class ParallelModel:
    """This rank's part of a parallelised model and the operations a training loop needs.

    Attributes:
        model_parts: this rank's stage modules (the whole model when there is no pipeline).
        mesh: the device mesh, or ``None`` on one device.
        dp_rank, dp_size: this rank's data-parallel coordinate and the dp degree: the data
            loader gives each dp rank its share; tp and pp ranks of one replica get the same.
        is_last_stage: whether this rank computes the loss (always true without a pipeline).
        placement_report: ``{module FQN: style}`` from tensor parallelism, per stage.
    """

    def __init__(
        self,
        *,
        model_parts: list[nn.Module],
        mesh: DeviceMesh | None,
        dp_rank: int = 0,
        dp_size: int = 1,
        stage_indices: Sequence[int] = (0,),
        pipeline: PipelineSpec | None = None,
        device: torch.device | str = "cpu",
        placement_report: dict[str, str] | None = None,
        autocast: torch.dtype | None = None,
        pp_group: dist.ProcessGroup | None = None,
        replicas: int = 1,
        lanes: int = 1,
        stage_to_group_rank: dict[int, int] | None = None,
    ) -> None:
        self.model_parts = model_parts
        self.mesh = mesh
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.stage_indices = list(stage_indices)
        num_stages = pipeline.num_stages if pipeline is not None else 1
        self.num_stages = num_stages
        self.is_first_stage = 0 in self.stage_indices
        self.is_last_stage = num_stages - 1 in self.stage_indices
        self.placement_report = placement_report or {}
        self._pipeline = pipeline
        self._device = torch.device(device)
        self._autocast = autocast
        self._schedule = None
        self._loss_fn: LossFn | None = None
        self._loss_factor = 1.0
        self.pp_size = num_stages // pipeline.stages_per_rank if pipeline is not None else 1
        self._pp_group = pp_group
        self._replicas = replicas  # ranks holding each stage (the last stage's all hold a loss)
        self._lanes = lanes  # per-stage layouts: lanes a micro-batch is split over between stages
        self._stage_to_group_rank = stage_to_group_rank
    # -- training step -------------------------------------------------------------

    def forward_backward(
        self, inputs: torch.Tensor, targets: torch.Tensor, loss_fn: LossFn, *, loss_scale: float = 1.0
    ) -> torch.Tensor | None:
        """Forward and backward over this rank's dp share of an (accumulation) batch.

        Backpropagates ``mean loss * loss_scale`` (gradients accumulate into ``.grad``; use
        ``loss_scale = 1 / grad_accum`` for accumulation). With a pipeline, runs the schedule
        over ``microbatches`` micro-batches; ``inputs`` matter only on the first stage's ranks
        and ``targets`` only on the last's. Returns the detached, unscaled mean loss on ranks
        holding the last stage, else ``None``.
        """
        if self._pipeline is None:
            (model,) = self.model_parts
            with self._precision():
                loss = loss_fn(model(inputs), targets)
            (loss * loss_scale if loss_scale != 1.0 else loss).backward()
            return loss.detach()
        with self._precision():
            return self._run_schedule(inputs, targets, loss_fn, loss_scale, backward=True)

    @torch.no_grad()
    def evaluate(self, inputs: torch.Tensor, targets: torch.Tensor, loss_fn: LossFn) -> torch.Tensor | None:
        """The mean loss of a forward-only pass over this rank's dp share of a batch (on the
        last stage's ranks, else ``None``); no gradient is computed or touched. Combine the
        ranks' values with :meth:`reduce_loss`."""
        if self._pipeline is None:
            (model,) = self.model_parts
            with self._precision():
                loss = loss_fn(model(inputs), targets)
        elif self._pipeline.schedule == "ZBV":
            raise NotImplementedError("the ZBV schedule has no forward-only pass in torch; evaluate with another schedule")
        else:
            with self._precision():
                loss = self._run_schedule(inputs, targets, loss_fn, 1.0, backward=False)
        # FSDP keeps what it gathered without resharding after forward (the root, zero2, pipeline
        # stages) until a backward that never comes here: give the module its sharded fp32
        # parameters back, as the optimizer and a checkpoint expect them.
        for part in self.model_parts:
            for module in part.modules():
                if isinstance(module, FSDPModule):
                    module.reshard()
        return loss

    def _precision(self):
        """bf16 autocast where no FSDP mixed-precision policy casts the parameters (one device,
        tp, pp without dp): matmuls in bf16, fp32 weights and gradients. Else a no-op."""
        if self._autocast is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self._device.type, dtype=self._autocast)

    def _run_schedule(self, inputs: torch.Tensor, targets: torch.Tensor, loss_fn: LossFn, loss_scale: float,
                      *, backward: bool) -> torch.Tensor | None:
        microbatches = self._pipeline.num_microbatches
        # Each micro-batch's loss is divided by their number here (not by the schedule's
        # scale_grads, which would also rescale gradients accumulated by earlier calls), and by the
        # lanes it is split over between stages of their own layouts (parallel.pipeline.stage_io).
        self._loss_fn, self._loss_factor = loss_fn, loss_scale / microbatches / self._lanes
        losses: list[torch.Tensor] = []
        args = (inputs,) if self.is_first_stage else ()
        target = targets if self.is_last_stage else None
        run = self.schedule.step if backward else self.schedule.eval
        run(*args, target=target, losses=losses, return_outputs=False)
        if not self.is_last_stage:
            return None
        # Micro-batches are equal slices, so the batch mean is the mean of their means:
        # sum(loss_i * scale / M / lanes) / (scale / lanes).
        return torch.stack([loss.detach() for loss in losses]).sum() * self._lanes / loss_scale

    @property
    def schedule(self) -> Any:
        """The torch pipelining schedule running this rank's stages (built on first use: the
        stages and the schedule's ``pipeline_order``), or ``None`` without a pipeline."""
        if self._pipeline is None:
            return None
        if self._schedule is None:
            self._schedule = build_schedule(
                list(zip(self.stage_indices, self.model_parts)),
                schedule=self._pipeline.schedule,
                microbatches=self._pipeline.num_microbatches,
                loss_fn=self._scaled_loss,
                num_stages=self.num_stages,
                pp_group=self._pp_group,
                device=self._device,
                stage_to_group_rank=self._stage_to_group_rank,
            )
        return self._schedule

    def _scaled_loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        # The schedule holds this function; the user's loss and factor are set per call.
        return self._loss_fn(output, target) * self._loss_factor

    # -- parameters and gradients ----------------------------------------------------

    def parameters(self) -> Iterator[nn.Parameter]:
        """This rank's parameters (DTensors where sharded), each once."""
        for _, p in self.named_parameters():
            yield p

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """``(FQN, parameter)`` over all of this rank's stages; FQNs are the full model's."""
        seen: set[int] = set()
        for part in self.model_parts:
            for name, p in part.named_parameters():
                if id(p) not in seen:
                    seen.add(id(p))
                    yield name, p

    def train(self, mode: bool = True) -> ParallelModel:
        for part in self.model_parts:
            part.train(mode)
        return self

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float | None) -> float:
        """The global L2 norm of all gradients (over every rank, stage and shard); if
        ``max_norm`` is given, scales the gradients as ``torch.nn.utils.clip_grad_norm_`` would.

        Each rank adds its local squared norms, divided by how many ranks hold the same
        values (the replicas of a shard), and one all-reduce over the world sums them.
        """
        for p in self.parameters():
            g = p.grad
            if isinstance(g, DTensor) and any(isinstance(pl, Partial) for pl in g.placements):
                # Sum a pending Partial gradient (sequence-parallel norm weights) once, here: left
                # Partial, every optimizer op touching it would all-reduce it again.
                p.grad = g.redistribute(g.device_mesh, [Replicate() if isinstance(pl, Partial) else pl for pl in g.placements])
        grads = [p.grad for p in self.parameters() if p.grad is not None]
        holders = self._replicas
        total = torch.zeros((), dtype=torch.float64, device=self._device)
        for g in grads:
            if isinstance(g, DTensor):
                shards = math.prod(g.device_mesh.size(i) for i, pl in enumerate(g.placements) if _is_shard(pl))
                local = g.to_local()
            else:
                shards, local = 1, g
            total += local.double().square().sum() / (holders // shards)
        if self.mesh is not None:
            dist.all_reduce(total)
        norm = float(total.sqrt())
        if max_norm is not None:
            # Same arithmetic as torch.nn.utils.clip_grad_norm_ (so one device matches exactly).
            coef = torch.clamp(torch.tensor(max_norm, dtype=torch.float32) / (torch.tensor(norm, dtype=torch.float32) + 1e-6), max=1.0)
            for g in grads:
                (g.to_local() if isinstance(g, DTensor) else g).mul_(coef.to(g.dtype))
        return norm

    def reduce_loss(self, loss: torch.Tensor | None) -> float:
        """The global mean loss, identical on every rank: the mean over dp replicas of the
        loss held by the last stage's ranks (``None`` elsewhere)."""
        if self.mesh is None:
            return float(loss)
        value = torch.tensor([0.0 if loss is None else float(loss)], dtype=torch.float64)
        dist.all_reduce(value)
        # Every rank of the last stage holds a loss: dp replicas (and lanes) differ, tp ranks repeat them.
        return float(value) / self._replicas


def _is_shard(placement: Any) -> bool:
    # FSDP over a tp-sharded dim uses _StridedShard, which is not a Shard subclass and whose
    # is_shard() is False in torch 2.13; every shard-like placement has a tensor `dim`.
    return isinstance(placement, Shard) or getattr(placement, "dim", None) is not None


def parallelize(model: nn.Module, plan: ParallelPlan, *, device: torch.device,
                init: Callable[[nn.Module], None] | None = None, precision: Precision = "fp32",
                compile: bool = False) -> ParallelModel:
    """Spread ``model`` over the plan's mesh; returns this rank's :class:`ParallelModel`.

    Args:
        model: the whole model, either initialised on CPU (identically on every rank) or built
            on the ``meta`` device (names and shapes only). A meta model is split and sharded
            as it is, then each part is allocated on ``device`` (``to_empty``) and ``init(part)``
            fills this rank's shards: no rank ever allocates a parameter it does not hold.
        plan: from :func:`parallel.plan.resolve.resolve_plan` for this model and config.
        device: where this rank computes (``cpu``, or its own ``cuda`` device).
        init: with a meta model, fills a materialised part's parameters and buffers (the
            trainer passes the model's ``init_weights(seed)``, which computes each shard's
            block of the full value, so every mesh starts from one device's values).
        precision: ``bf16``: bf16 compute over fp32 master weights, optimizer state and
            gradient reduction; FSDP2's mixed-precision policy where data parallelism applies
            (every mode is FSDP2-based), ``torch.autocast`` otherwise.
        compile: ``torch.compile`` each block (:func:`parallel.sharding.compile.apply_compile`), or the
            whole module when the model has no blocks; parameter names do not change.
    """
    on_meta = any(p.is_meta for p in model.parameters())
    if on_meta and init is None:
        raise ValueError("a model on the meta device needs init= to give its shards their values")
    part_options = dict(device=device, init=init if on_meta else None, precision=precision, compile=compile)
    if plan.mesh.world_size == 1:  # no placements, no data parallelism: materialise, AC, compile
        _parallelize_part(model, None, plan, pipelined=False, **part_options)
        return ParallelModel(model_parts=[model], mesh=None, device=device, autocast=_autocast_dtype(precision, None))

    pp = plan.pipeline
    if compile and pp is not None and pp.schedule in SPLIT_BACKWARD_SCHEDULES:
        raise ValueError(f"torch.compile does not compose with the {pp.schedule} schedule (its weight-gradient pass "
                         "re-runs a compiled block's whole backward); use 1F1B or Interleaved1F1B, or compile=False")
    if pp is not None and pp.stages:
        return _parallelize_stages(model, plan, **part_options)
    # Explicit mesh rank ids only say which device each position's worker runs on (the launcher bound
    # it): the world mesh itself is always torch ranks 0..n-1 row-major.
    mesh = build_mesh(plan.mesh.shape, plan.mesh.dim_names, device_type=device.type)
    if dist.get_world_size() != mesh.size():
        raise ValueError(f"the mesh has {mesh.size()} ranks but the world has {dist.get_world_size()}")
    if pp is not None:
        stages = split_stages(model, pp, units=plan.units, pp_rank=mesh.get_local_rank(pp.dim))
    else:
        stages = [(0, model)]
    report: dict[str, str] = {}
    for _, part in stages:
        report.update(_parallelize_part(part, mesh, plan, pipelined=pp is not None, **part_options))
    dp_names = list(plan.data_parallel.dim_names) if plan.data_parallel is not None else []
    return ParallelModel(
        model_parts=[part for _, part in stages],
        mesh=mesh,
        dp_rank=axis_rank(mesh, dp_names),
        dp_size=plan.dp_size,
        stage_indices=[index for index, _ in stages],
        pipeline=pp,
        device=device,
        placement_report=report,
        autocast=_autocast_dtype(precision, plan.data_parallel),
        pp_group=mesh.get_group(pp.dim) if pp is not None else None,
        replicas=mesh.size() // plan.pp_size,
    )


def _parallelize_part(part: nn.Module, mesh: DeviceMesh | None, layout: ParallelPlan, *, pipelined: bool, device: torch.device,
                      init: Callable[[nn.Module], None] | None, precision: Precision, compile: bool) -> dict[str, str]:
    """One model part (the model, or a pipeline stage) on ``mesh`` as ``layout`` places it:
    tensor parallel -> activation checkpointing -> compile -> data parallel -> (``init``: a meta
    part) allocate and initialise this rank's shards. Returns tensor parallelism's report. A tied
    parameter (input and output embeddings) stays one parameter throughout (:mod:`parallel.sharding.ties`)."""
    report: dict[str, str] = {}
    tied = tied_groups(part)
    if init is None:
        part.to(device)
    if layout.placements or layout.layouts:
        report = apply_placements(part, mesh, placements=layout.placements, layouts=layout.layouts)
    apply_ac(part, mode=layout.activation_checkpointing, every=layout.activation_checkpointing_every,
             block_fqns=layout.blocks)
    if compile:
        apply_compile(part, block_fqns=layout.blocks)
    dp = layout.data_parallel
    if dp is not None:
        apply_data_parallel(part, mesh, mode=dp.mode, dim_names=list(dp.dim_names), block_fqns=layout.blocks,
                            pipelined=pipelined, precision=precision)
    if init is not None:
        _materialize(part, device, init, tied)
    retie(part, tied)
    return report


def _parallelize_stages(model: nn.Module, plan: ParallelPlan, *, device: torch.device,
                        init: Callable[[nn.Module], None] | None, precision: Precision, compile: bool) -> ParallelModel:
    """Per-stage layouts (``parallel.pipeline.stages``): every stage on its own sub-mesh with its
    own layout, the schedule along lanes of one rank per stage (:mod:`parallel.pipeline.stage_io`)."""
    pp = plan.pipeline
    if dist.get_world_size() != plan.mesh.world_size:
        raise ValueError(f"the mesh has {plan.mesh.world_size} ranks but the world has {dist.get_world_size()}")
    # Every rank builds every stage's mesh and every lane's group: both are collectives.
    meshes = [build_mesh(s.layout.mesh.shape, s.layout.mesh.dim_names, rank_ids=s.rank_ids, device_type=device.type)
              for s in pp.stages]
    lanes = lane_groups([s.ranks for s in pp.stages])
    rank = dist.get_rank()
    index = next(i for i, s in enumerate(pp.stages) if rank in s.ranks)
    stage, mesh = pp.stages[index], meshes[index]
    lane = stage.ranks.index(rank)
    (_, part), = split_stages(model, pp, units=plan.units, pp_rank=index)
    report = _parallelize_part(part, mesh, stage.layout, pipelined=True, device=device, init=init,
                               precision=precision, compile=compile)
    dp = stage.layout.data_parallel
    attach_boundaries(part, mesh, dp_axes=dp.dim_names if dp is not None else ())
    lane_ranks, lane_group = lanes[lane]
    return ParallelModel(
        model_parts=[part], mesh=mesh, dp_rank=lane, dp_size=len(stage.ranks), stage_indices=[index], pipeline=pp,
        device=device, placement_report=report, autocast=_autocast_dtype(precision, dp), pp_group=lane_group,
        replicas=len(stage.ranks), lanes=len(stage.ranks), stage_to_group_rank=stage_to_group_rank(lane_ranks),
    )


def _autocast_dtype(precision: Precision, dp: Any) -> torch.dtype | None:
    # With data parallelism FSDP2's policy already computes in bf16; autocast on top would only re-cast.
    return torch.bfloat16 if precision == "bf16" and dp is None else None


def _materialize(part: nn.Module, device: torch.device, init: Callable[[nn.Module], None] | None,
                 tied: list[list[str]]) -> None:
    """Move ``part`` to ``device``; a meta part is allocated there (its shards only: after
    tensor and data parallelism a DTensor's local tensor is the shard) and given its values.
    ``to_empty`` allocates each module's tensors apart, so ties are restored before ``init``,
    which then gives a tied parameter its first name's value, as on one device."""
    if init is None:
        part.to(device)
        return
    part.to_empty(device=device)
    retie(part, tied)
    init(part)


__all__ = ["ParallelModel", "parallelize", "submesh"]
