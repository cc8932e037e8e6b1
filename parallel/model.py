"""What a training loop holds: this rank's part of a parallelised model (:func:`parallel.engine.parallelize`
builds it) and the operations a step needs: forward and backward over a pipeline schedule or
one module, evaluation, the global gradient norm and clipping, and the global mean loss.

    loss = pm.forward_backward(inputs, targets, loss_fn)     # this rank's dp share of the batch
    grad_norm = pm.clip_grad_norm_(1.0)                       # ties summed first (once per step)
    optimizer.step(); optimizer.zero_grad()
    print(pm.reduce_loss(loss))                               # the global mean, on every rank

(The optimizer is built over ``pm.parameters()`` and passed through ``pm.shard_optimizer(optimizer)``,
which shards its state under ``zero1``.)
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.parallel import loss_parallel

from parallel.pipeline.schedule import build_schedule
from parallel.pipeline.stage_terms import carry_term
from parallel.pipeline.ties import StageTies
from parallel.plan.spec import PipelineSpec
from parallel.sharding.head_params import HeadGradients
from parallel.sharding.zero1 import shard_optimizer_state

if TYPE_CHECKING:
    from torch.distributed.pipelining.schedules import _PipelineSchedule

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class ParallelModel:
    """This rank's part of a parallelised model and the operations a training loop needs.

    Attributes:
        model_parts: this rank's stage modules (the whole model when there is no pipeline).
        mesh: the device mesh, or ``None`` on one device.
        dp_rank, dp_size: this rank's data-parallel coordinate and the dp degree: the data
            loader gives each dp rank its share; tp and pp ranks of one replica get the same.
        cp_rank, cp_size: this rank's context-parallel coordinate and the cp degree: each cp rank
            gets its chunks of the same rows (:func:`parallel.context.shard_sequence`).
        is_last_stage: whether this rank computes the loss (always true without a pipeline).
        replicas: how many ranks hold this rank's stage (the world without a pipeline).
        repeats: how many of those see the same rows (tensor parallelism's ranks): they count a row once.
        placement_report: ``{module FQN: style}`` from tensor parallelism, per stage.
        tied_names: the model's tied parameters' names, first name first; a pipeline holds one
            copy per stage of a tie's names (:mod:`parallel.pipeline.ties`).
    """

    def __init__(
        self,
        *,
        model_parts: list[nn.Module],
        mesh: DeviceMesh | None,
        dp_rank: int = 0,
        dp_size: int = 1,
        cp_rank: int = 0,
        cp_size: int = 1,
        stage_indices: Sequence[int] = (0,),
        pipeline: PipelineSpec | None = None,
        device: torch.device | str = "cpu",
        placement_report: dict[str, str] | None = None,
        autocast: torch.dtype | None = None,
        pp_group: dist.ProcessGroup | None = None,
        replicas: int = 1,
        repeats: int = 1,
        lanes: int = 1,
        stage_to_group_rank: dict[int, int] | None = None,
        ties: StageTies | None = None,
        tied_names: list[list[str]] | None = None,
        heads: HeadGradients | None = None,
        loss_parallel: bool = False,
        optimizer_shard_axes: Sequence[str] = (),
    ) -> None:
        self.model_parts = model_parts
        self.mesh = mesh
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.cp_rank, self.cp_size = cp_rank, cp_size
        self.stage_indices = list(stage_indices)
        num_stages = pipeline.num_stages if pipeline is not None else 1
        self.num_stages = num_stages
        self.is_first_stage = 0 in self.stage_indices
        self.is_last_stage = num_stages - 1 in self.stage_indices
        self.placement_report = placement_report or {}
        self._pipeline = pipeline
        self._device = torch.device(device)
        self._autocast = autocast
        self._schedule: _PipelineSchedule | None = None
        self._loss_fn: LossFn | None = None
        self._loss_factor = 1.0
        self._stage_term: Callable[[nn.Module], torch.Tensor | None] | None = None
        self._term_total: torch.Tensor | None = None  # this call's stage terms, scaled as the losses
        self._inferring = False  # the schedule's metadata inference is running
        self._pp_group = pp_group
        self.replicas = replicas  # ranks holding each stage (the last stage's all hold a loss)
        self.repeats = repeats
        self._lanes = lanes  # per-stage layouts: lanes a micro-batch is split over between stages
        self._stage_to_group_rank = stage_to_group_rank
        self._ties = ties or StageTies()
        self._heads = heads or HeadGradients()
        self.tied_names = tied_names or []  # the whole model's tied names, first name first (a checkpoint's keys)
        # The head's logits are vocabulary shards (a Shard(2) DTensor): the loss, and its backward, run under
        # torch's loss_parallel, whose cross-entropy reduces over the shards instead of gathering them.
        self.loss_parallel = loss_parallel
        # zero1: the data-parallel axes its optimizer's state is sharded over (none for every other mode).
        self.optimizer_shard_axes = tuple(optimizer_shard_axes)
    # -- training step -------------------------------------------------------------

    def forward_backward(
        self, inputs: torch.Tensor, targets: torch.Tensor, loss_fn: LossFn, *, loss_scale: float = 1.0,
        positions: torch.Tensor | None = None, reduce_grads: bool = True,
    ) -> torch.Tensor | None:
        """Forward and backward over this rank's dp share of an (accumulation) batch.

        Backpropagates ``mean loss * loss_scale`` (gradients accumulate into ``.grad``; use
        ``loss_scale = 1 / grad_accum`` for accumulation). With a pipeline, runs the schedule
        over ``microbatches`` micro-batches; ``inputs`` matter only on the first stage's ranks
        and ``targets`` only on the last's. Returns the detached, unscaled mean loss on ranks
        holding the last stage, else ``None``. ``positions``: packed documents' positions, given to
        every stage's forward (every rank passes them).

        With a pipeline, ``loss_fn`` may also have a ``stage_term(module)`` method: a loss term of a
        stage's own modules after its forward (a scalar with its graph, or ``None``), such as an MoE
        block's balance loss, added to the objective on that stage (:mod:`parallel.pipeline.stage_terms`);
        the value returned then includes this rank's terms too (on every rank that has some), so that
        :meth:`reduce_loss` gives the whole objective.

        ``reduce_grads=False``: an accumulation pass before the step's last. Under ``zero1`` (no pipeline) the
        gradients then stay this rank's own, summed locally, and are all-reduced once, in the last pass's
        backward (FSDP2's ``set_requires_gradient_sync``), as Megatron's distributed optimizer reduces once a
        step; every other mode reduces every pass, as its memory model counts.
        """
        if self._pipeline is None:
            (model,) = self.model_parts
            if self.optimizer_shard_axes and isinstance(model, FSDPModule):
                model.set_requires_gradient_sync(reduce_grads)
            with self._loss_context():
                with self._precision():
                    loss = _plain(loss_fn(model(inputs, **_extra(positions)), targets))
                (loss * loss_scale if loss_scale != 1.0 else loss).backward()  # type: ignore[no-untyped-call]  # torch
            return loss.detach()
        with self._precision(), self._loss_context():
            return self._run_schedule(inputs, targets, loss_fn, loss_scale, backward=True, positions=positions)

    @torch.no_grad()
    def evaluate(self, inputs: torch.Tensor, targets: torch.Tensor, loss_fn: LossFn,
                 positions: torch.Tensor | None = None) -> torch.Tensor | None:
        """The mean loss of a forward-only pass over this rank's dp share of a batch (on the
        last stage's ranks, else ``None``); no gradient is computed or touched. Combine the
        ranks' values with :meth:`reduce_loss`."""
        if self._pipeline is None:
            (model,) = self.model_parts
            with self._precision(), self._loss_context():
                loss: torch.Tensor | None = _plain(loss_fn(model(inputs, **_extra(positions)), targets))
        elif self._pipeline.schedule == "ZBV":
            raise NotImplementedError("the ZBV schedule has no forward-only pass in torch; evaluate with "
                                      "another schedule")
        else:
            with self._precision(), self._loss_context():
                loss = self._run_schedule(inputs, targets, loss_fn, 1.0, backward=False, positions=positions)
        # FSDP keeps what it gathered without resharding after forward (the root, zero2, pipeline
        # stages) until a backward that never comes here: give the module its sharded fp32
        # parameters back, as the optimizer and a checkpoint expect them.
        for part in self.model_parts:
            for module in part.modules():
                if isinstance(module, FSDPModule):
                    module.reshard()
        return loss

    def _precision(self) -> contextlib.AbstractContextManager[Any]:
        """bf16 autocast where no FSDP mixed-precision policy casts the parameters (one device,
        tp, pp without dp): matmuls in bf16, fp32 weights and gradients. Else a no-op."""
        if self._autocast is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self._device.type, dtype=self._autocast)

    def _loss_context(self) -> contextlib.AbstractContextManager[Any]:
        """torch's ``loss_parallel`` with a vocabulary-sharded head (forward and backward both inside), else a no-op."""
        return loss_parallel() if self.loss_parallel else contextlib.nullcontext()

    def _run_schedule(self, inputs: torch.Tensor, targets: torch.Tensor, loss_fn: LossFn, loss_scale: float,
                      *, backward: bool, positions: torch.Tensor | None = None) -> torch.Tensor | None:
        assert self._pipeline is not None, "only a pipelined model runs a schedule"
        microbatches = self._pipeline.num_microbatches
        # Each micro-batch's loss is divided by their number here (not by the schedule's
        # scale_grads, which would also rescale gradients accumulated by earlier calls), and by the
        # lanes it is split over between stages of their own layouts (parallel.pipeline.stage_io).
        self._loss_fn, self._loss_factor = loss_fn, loss_scale / microbatches / self._lanes
        self._stage_term, self._term_total = getattr(loss_fn, "stage_term", None), None
        losses: list[torch.Tensor] = []
        args = (inputs,) if self.is_first_stage else ()
        target = targets if self.is_last_stage else None
        run = self.schedule.step if backward else self.schedule.eval
        # Keyword inputs are split into micro-batches like the inputs and reach every stage.
        run(*args, target=target, losses=losses, return_outputs=False, **_extra(positions))
        terms, self._stage_term, self._term_total = self._term_total, None, None
        if not self.is_last_stage:
            return None if terms is None else terms * self._lanes / loss_scale
        # Micro-batches are equal slices, so the batch mean is the mean of their means:
        # sum(loss_i * scale / M / lanes) / (scale / lanes).
        total = torch.stack([loss.detach() for loss in losses]).sum()
        return (total if terms is None else total + terms) * self._lanes / loss_scale

    @property
    def pipelined(self) -> bool:
        """Whether this model runs a pipeline schedule (its parts are stages)."""
        return self._pipeline is not None

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
            for part in self.model_parts:
                part.register_forward_hook(self._carry_stage_term)
            self._skip_terms_in_metadata_inference(self._schedule)
        return self._schedule

    def _skip_terms_in_metadata_inference(self, schedule: Any) -> None:
        """Torch's schedules infer the shapes between stages by running each stage (and its loss and
        backward) once on a micro-batch or on empty tensors, at their first step and after a switch between
        evaluation and training, all in ``_initialize_pp_stages`` (torch 2.13); a stage term of that run
        is no term of the objective, so the hook leaves it out."""
        initialize = getattr(schedule, "_initialize_pp_stages", None)
        if initialize is None:
            return

        def without_terms(*args: Any, **kwargs: Any) -> Any:
            self._inferring = True
            try:
                return initialize(*args, **kwargs)
            finally:
                self._inferring = False

        schedule._initialize_pp_stages = without_terms

    def _scaled_loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        # The schedule holds this function; the user's loss and factor are set per call.
        assert self._loss_fn is not None, "_run_schedule sets the loss before the schedule runs"
        return _plain(self._loss_fn(output, target)) * self._loss_factor

    def _carry_stage_term(self, module: nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor | None:
        """Forward hook of every stage module: its output carries the loss's term of that stage's modules
        (``loss_fn.stage_term``), scaled as the micro-batch's loss is, so its gradient flows on this stage."""
        if self._stage_term is None or self._inferring or not torch.is_grad_enabled():
            return None
        term = self._stage_term(module)
        if term is None:
            return None
        value = term.detach() * self._loss_factor
        self._term_total = value if self._term_total is None else self._term_total + value
        # The term is a mean over the rows this rank's stage sees, as a uniform layout's rank's loss is: its
        # gradient is the micro-batch's share, not the lane's (per-stage layouts: their data parallelism
        # averages it, parallel.pipeline.stage_io), so the lanes' division is taken back.
        return carry_term(output, term, self._loss_factor * self._lanes)

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

        Call it once per optimizer step, after the last ``forward_backward``: it first sums the
        gradients of a tied parameter's copies on different pipeline stages (which then count once),
        and the tensor-parallel ranks' shares of per-head parameters' gradients
        (:mod:`parallel.sharding.head_params`).
        """
        for p in self.parameters():
            g = p.grad
            if isinstance(g, DTensor) and any(isinstance(pl, Partial) for pl in g.placements):
                # Sum a pending Partial gradient (sequence-parallel norm weights) once, here: left
                # Partial, every optimizer op touching it would all-reduce it again.
                p.grad = g.redistribute(g.device_mesh,
                                        [Replicate() if isinstance(pl, Partial) else pl for pl in g.placements])
        self._ties.sum_grads()
        self._heads.sum_grads()
        aliases = self._ties.alias_copies
        grads = [p.grad for p in self.parameters() if p.grad is not None]
        counted = [p.grad for p in self.parameters() if p.grad is not None and id(p) not in aliases]
        holders = self.replicas
        total = torch.zeros((), dtype=torch.float64, device=self._device)
        for g in counted:
            local = g.to_local() if isinstance(g, DTensor) else g
            total += local.double().square().sum() / (holders // shard_count(g))
        if self.mesh is not None:
            dist.all_reduce(total)
        norm = float(total.sqrt())
        if max_norm is not None:
            # Same arithmetic as torch.nn.utils.clip_grad_norm_ (so one device matches exactly).
            coef = torch.clamp(torch.tensor(max_norm,
                                            dtype=torch.float32) / (torch.tensor(norm, dtype=torch.float32) + 1e-6),
                               max=1.0)
            for g in grads:
                (g.to_local() if isinstance(g, DTensor) else g).mul_(coef.to(g.dtype))
        return norm

    def shard_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """``optimizer`` (over :meth:`parameters`) as the plan's data parallelism wants it: under ``zero1``
        its state sharded over the dp axes (:func:`parallel.sharding.zero1.shard_optimizer_state`);
        unchanged under every other mode (FSDP2's modes shard the parameters, and so the state, already)."""
        if not self.optimizer_shard_axes:
            return optimizer
        return shard_optimizer_state(optimizer, dim_names=self.optimizer_shard_axes)

    def copy_tied_values(self) -> None:
        """Give every stage's copy of a tied parameter its first name's values: after loading
        weights that name the first only (a Hugging Face file, an exported model)."""
        self._ties.copy_values()

    def reduce_loss(self, loss: torch.Tensor | None) -> float:
        """The global mean loss, identical on every rank: the mean over dp replicas of the
        loss held by the last stage's ranks (``None`` elsewhere)."""
        if self.mesh is None:
            assert loss is not None, "one device holds the last stage, so its loss"
            return float(loss)
        value = torch.tensor([0.0 if loss is None else float(loss)], dtype=torch.float64)
        dist.all_reduce(value)
        # Every rank of the last stage holds a loss: dp replicas (and lanes) differ, tp ranks repeat them.
        return float(value) / self.replicas


def _extra(positions: torch.Tensor | None) -> dict[str, torch.Tensor]:
    """The model's keyword inputs: none for a plain batch (a custom model need not take them)."""
    return {} if positions is None else {"positions": positions}


def _plain(loss: torch.Tensor) -> torch.Tensor:
    """A loss as a plain tensor: loss parallel's cross-entropy is a replicated DTensor (every rank the same
    value), whose local tensor carries the gradient back to the shards."""
    return loss.to_local() if isinstance(loss, DTensor) else loss


def _is_shard(placement: Any) -> bool:
    # FSDP over a tp-sharded dim uses _StridedShard, which is not a Shard subclass and whose
    # is_shard() is False in torch 2.13; every shard-like placement has a tensor `dim`.
    return isinstance(placement, Shard) or getattr(placement, "dim", None) is not None


def shard_count(t: torch.Tensor) -> int:
    """Into how many distinct blocks a DTensor is split over its mesh (1: a plain tensor, or replicated)."""
    if not isinstance(t, DTensor):
        return 1
    return math.prod(t.device_mesh.size(i) for i, pl in enumerate(t.placements) if _is_shard(pl))


__all__ = ["LossFn", "ParallelModel", "shard_count"]
