"""The ``mesh`` and ``parallel`` sections of a run config, as frozen pydantic models.

The engine owns the words it understands: the data-parallel modes, the pipeline schedules, the
activation-checkpointing modes and the placement grammar are declared here once, and the
trainer's :class:`~trainer.config.schema.RunConfig` embeds these sections. What the user wrote (globs,
``boundaries: auto``) is turned into a :class:`~parallel.plan.spec.ParallelPlan` by
:func:`~parallel.plan.resolve.resolve_plan`; nothing in ``parallel/`` reads these sections any other way.

    ParallelConfig.model_validate({"dims": ["dp", "tp"], "data_parallel": {"dim": "dp", "mode": "fsdp"},
                                   "placements": {"layers.*.mlp.w1.weight": {"tp": "Shard(0)"}}})
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, PlainSerializer

from parallel.placements import PlacementSpec, parse_placement
# Re-exported: a mesh value's words.
from parallel.topology import mesh_rank_ids as mesh_rank_ids, mesh_shape_of as mesh_shape_of


class Section(BaseModel):
    """Base of every config section: unknown keys are errors, values are frozen."""

    # coerce_numbers_to_str: Hydra reads `run_name=412` as an int; a name is still a name.
    model_config = ConfigDict(extra="forbid", frozen=True, coerce_numbers_to_str=True)


Placement = Annotated[PlacementSpec, BeforeValidator(parse_placement), PlainSerializer(str, return_type=str)]
AxisPlacements = dict[str, Placement]

DataParallelMode = Literal["ddp", "zero1", "fsdp", "zero2", "hsdp"]
# Modes whose parameters (and gradients) stay whole on every dp rank: FSDP2's replicate (zero1: its optimizer's
# state sharded over dp); the others shard parameters with fully_shard.
REPLICATED_DP_MODES = ("ddp", "zero1")
ScheduleName = Literal["GPipe", "1F1B", "Interleaved1F1B", "InterleavedZeroBubble", "ZBV"]
# full: whole blocks recomputed (every block, or every n-th with activation_checkpointing_every); selective:
# Megatron-LM's selective recomputation, only each block's attention core (Korthikanti et al. 2022, sec. 5).
ActivationCheckpointing = Literal["none", "full", "selective"]
# Compute precision: fp32, or bf16 compute over fp32 master weights, optimizer state and gradient reduction.
Precision = Literal["fp32", "bf16"]
INTERLEAVED_SCHEDULES = ("Interleaved1F1B", "InterleavedZeroBubble")
V_SCHEDULES = ("ZBV",)  # two stages per rank, placed as a V
MULTI_STAGE_SCHEDULES = INTERLEAVED_SCHEDULES + V_SCHEDULES
# Zero-bubble schedules: input and weight gradients in separate backward passes (the first retains the graph);
# torch.compile does not compose with them (see parallel/sharding/compile.py).
SPLIT_BACKWARD_SCHEDULES = ("InterleavedZeroBubble", "ZBV")


class DataParallelConfig(Section):
    dim: str | list[str] = Field(
        "dp", description="Mesh axis name for data parallelism; hsdp takes two: [replicate_axis, shard_axis]."
    )
    mode: DataParallelMode = Field(
        "fsdp", description="ddp (replicate), zero1 (replicate, optimizer state sharded), fsdp (ZeRO-3), zero2 (no "
        "reshard after forward), hsdp (2-D)."
    )

    @property
    def dim_names(self) -> list[str]:
        return [self.dim] if isinstance(self.dim, str) else list(self.dim)


class TensorParallelConfig(Section):
    dim: str = Field("tp", description="Mesh axis name the model's tensor-parallel plan splits over.")
    plan: Literal["megatron"] = Field(
        "megatron",
        description="The model family's named plan: megatron = attention and MLP column- then row-parallel "
        "(the model provides the globs; explicit `placements` / `layouts` override it).",
    )
    sequence_parallel: bool = Field(
        False, description="Also run the block norms on sequence shards (Shard(1)); the projections keep each "
        "norm's gathered output for backward as its shard and gather it again there (Megatron-LM's way).")
    loss_parallel: bool = Field(
        True, description="Loss parallel (on by default, as torchtitan and Megatron-LM do): the output head is "
        "column-parallel over this axis (each rank holds vocab/tp rows of it; a tied input embedding is split "
        "alike), the logits stay vocabulary shards and the cross-entropy is computed on the shards "
        "(torch's loss_parallel), so no rank holds the whole vocabulary's logits. A vocabulary that does not divide "
        "by the axis size keeps the head whole, with a warning; false = the head replicated and the whole logits "
        "on every tp rank.")


ContextParallelMethod = Literal["ring", "allgather"]


class ContextParallelConfig(Section):
    """``parallel.context_parallel``: every sequence split over a mesh axis (:mod:`parallel.context`)."""

    dim: str = Field("cp", description="Mesh axis name each sequence is split over: cp rank i holds the i-th and the "
                     "(2 cp - 1 - i)-th of 2 cp equal chunks of every row, so causal attention costs every rank the "
                     "same. Its ranks also shard the parameters, as more data-parallel ranks (FSDP over dp x cp).")
    method: ContextParallelMethod = Field(
        "ring", description="How attention sees the whole sequence: ring = K/V blocks passed around the cp ranks, "
        "partial results merged by their log-sum-exp (two blocks alive at a time); allgather = K/V of the whole "
        "sequence gathered once per layer (one collective, the full K/V alive per layer). Both are exact.")


class ExpertParallelConfig(Section):
    """Expert parallelism: a mixture-of-experts model's stacked experts split ``Shard(0)`` over the axis ``dim``,
    each token sent to the rank holding its expert and back by all-to-all. The axis also splits the batch, as a
    data-parallel axis does: the other parameters are replicated over it (or, with data_parallel mode fsdp or
    zero2, sharded over it with the dp axes)."""

    dim: str = Field("ep", description="Mesh axis name the experts are split over (and the batch with them).")


class GridParallelConfig(Section):
    """Colossal-AI's 2-D (Optimus / SUMMA) and 2.5-D (Tesseract) tensor parallelism (``+parallel=tp2d``,
    ``+parallel=tp2p5d``): every block's Linears and activations partitioned over a q x q grid of ranks
    (:mod:`parallel.sharding.tp_grid`)."""

    rows: str = Field("row", description="Mesh axis of the grid's rows: the tokens (batch rows) and each Linear's "
                      "input features are split over it.")
    cols: str = Field("col", description="Mesh axis of the grid's columns, as long as rows: the hidden (and so the "
                      "attention heads) and each Linear's output features are split over it.")
    depth: str | None = Field(None, description="2.5-D: mesh axis of the grid's layers (Tesseract's depth d): the "
                              "batch is split further over it and each layer holds the same weight blocks, their "
                              "gradients summed over it; null = 2-D.")

    @property
    def axes(self) -> dict[str, str]:
        """``{field: axis}`` of the axes the grid names."""
        return {"rows": self.rows, "cols": self.cols, **({"depth": self.depth} if self.depth else {})}


class Cube3DConfig(Section):
    """``parallel.tensor_parallel_3d``: Colossal-AI's 3-D tensor parallelism (:mod:`parallel.sharding.tp_cube`)."""

    dims: list[str] = Field(
        ["ca", "cb", "cc"], min_length=3, max_length=3,
        description="The three mesh axes of the q x q x q cube, in the paper's roles (a, b, c): a splits the token "
        "rows and gathers the weights, b and c alternate as the Linears' reduce and gather axes. Equal sizes.")


class LayoutConfig(Section):
    input: AxisPlacements | None = Field(None, description="Placement per mesh axis of the module's input.")
    output: AxisPlacements | None = Field(None, description="Placement per mesh axis of the module's output.")


class LayoutSection(Section):
    """What places a model on a mesh: the axes' names and roles, the named plan, the globs. The
    ``parallel`` section is one, and so is each ``parallel.pipeline.stages`` entry (on its ranks)."""

    dims: list[str] = Field(description="One name per mesh axis (a stage: per axis of its ranks), outermost first, "
                            "e.g. [dp, pp, tp].")
    data_parallel: DataParallelConfig | None = Field(None, description="Data parallelism; null = none.")
    tensor_parallel: TensorParallelConfig | None = Field(
        None, description="Tensor parallelism by the model family's named plan; null = only explicit placements."
    )
    placements: dict[str, AxisPlacements] = Field(
        default_factory=dict,
        description="Parameter-FQN glob -> {mesh axis: Shard(d) | Replicate}; axes not named are Replicate.",
    )
    layouts: dict[str, LayoutConfig] = Field(
        default_factory=dict, description="Module-FQN glob -> input/output placements (sequence parallel, Partial)."
    )


class StageConfig(LayoutSection):
    """One pipeline stage's own ranks and layout (``parallel.pipeline.stages[i]``); its globs
    match its own parameters and modules only."""

    ranks: list[int] | list[list[int]] = Field(
        description="Global ranks holding this stage: a list ([0, 1]) or a nested list for a 2-D sub-mesh "
                    "([[0,1],[2,3]]).",
    )
    context_parallel: ContextParallelConfig | None = Field(
        None, description="Context parallelism inside this stage: each micro-batch's sequences split over one of its "
        "axes (its ranks also shard the stage's parameters, as data-parallel ranks); activations cross the stage's "
        "boundaries as whole rows, re-split on the way in and joined on the way out; null = none.")
    expert_parallel: ExpertParallelConfig | None = Field(
        None, description="Expert parallelism inside this stage: its blocks' stacked experts Shard(0) over one of its "
        "axes, which splits the stage's rows as a data-parallel axis does; null = none.")

    @property
    def rank_list(self) -> list[int]:
        """The stage's ranks, row-major (the order its lanes are numbered in)."""
        return flat_ranks(self.ranks)

    @property
    def shape(self) -> tuple[int, ...]:
        """The sub-mesh's shape: ``(len(ranks),)`` for a list, rows x columns for a nested one."""
        if self.ranks and isinstance(self.ranks[0], list):
            return (len(self.ranks), len(self.ranks[0]))
        return (len(self.ranks),)


class PipelineConfig(Section):
    dim: str = Field("pp", description="Mesh axis name along which stages are laid out.")
    schedule: ScheduleName = Field("1F1B", description="torch.distributed.pipelining schedule.")
    # The schedule lists every micro-batch's actions on every stage (memory and time when it is built);
    # published pipelines cut a batch into at most a few hundred, and into no more than it has sequences.
    microbatches: int = Field(4, ge=1, le=4096, description="Micro-batches each (accumulation) batch is cut into; "
                              "at most 4096.")
    # Each stage is a module, its buffers and a peer of every other: interleaved schedules use a handful.
    stages_per_rank: int = Field(1, ge=1, le=64, description="Stages held by each pp rank; >= 2 for interleaved, "
                                 "2 for ZBV; at most 64.")
    boundaries: list[str] | Literal["auto"] = Field(
        "auto",
        description="First module of every stage but the first (e.g. [layers.2]); `auto` balances parameter counts.",
    )
    stages: list[StageConfig] | None = Field(
        None,
        description="Optional: each stage its own ranks and layout (dims, data_parallel, tensor_parallel, placements, "
        "layouts), one entry per stage; the mesh is then the world's ranks and the stage entries place them. "
        "null = every stage has the layout of the parallel section (one role per mesh axis).",
    )


class AutoPlanConfig(Section):
    """``+parallel=auto``: which layouts the auto-planner (``trainer.planner.auto.plan``) may choose from.
    Every list narrows the search; the defaults search everything the engine runs."""

    data_parallel_modes: list[DataParallelMode] = Field(
        ["ddp", "zero1", "fsdp", "zero2", "hsdp"], min_length=1, description="Data-parallel modes to consider (hsdp "
        "on every split of the dp ranks into replicate x shard groups).")
    schedules: list[ScheduleName] = Field(
        ["GPipe", "1F1B", "Interleaved1F1B", "InterleavedZeroBubble", "ZBV"], min_length=1,
        description="Pipeline schedules to consider.")
    microbatches: list[int] | None = Field(
        None, description="Micro-batch counts to consider; null = every count that divides a data-parallel rank's "
        "batch, up to max_microbatches.")
    grad_accum: list[Annotated[int, Field(ge=1, le=65536)]] | None = Field(
        None, description="Without a pipeline: gradient-accumulation steps (train.grad_accum) to consider, the "
        "micro-batches a data-parallel rank's batch is cut into; null = every count that divides that batch, up to "
        "max_microbatches (or train.grad_accum alone when it is set above 1).")
    # CPU: every count up to it multiplies the layouts the planner prices.
    max_microbatches: int = Field(16, ge=1, le=1024, description="The most micro-batches considered when "
                                  "microbatches is null; at most 1024.")
    stages_per_rank: list[int] = Field([2], min_length=1, description="Stages per rank for the interleaved schedules "
                                       "(ZBV always places 2).")
    activation_checkpointing: list[ActivationCheckpointing] = Field(
        ["none", "selective", "full"], min_length=1, description="Activation-checkpointing modes to consider: none, "
        "selective (every block's attention core recomputed), full (every block recomputed).")
    activation_checkpointing_every: list[Annotated[int, Field(ge=1)]] = Field(
        [1, 2], min_length=1, description="With full checkpointing: every n-th block checkpointed, each n listed "
        "(1 = every block; 2 = every other, about what a per-op selective policy such as torchtitan's recomputes).")
    sequence_parallel: list[bool] = Field(
        [False, True], min_length=1, description="With tensor parallelism: run the block norms on sequence shards "
        "(parallel.tensor_parallel.sequence_parallel), without, or both, as listed.")
    precisions: list[Precision] | None = Field(
        None, description="Compute precisions to consider (bf16 only where the device has native bf16 matmuls); "
        "null = the run's train.precision only, since precision changes the losses, not just the speed.")
    tensor_parallel: bool = Field(True, description="Consider the model family's Megatron tensor-parallel plan.")
    pipeline: bool = Field(True, description="Consider pipeline parallelism (boundaries: auto).")
    expert_parallel: bool = Field(True, description="Consider expert parallelism for a model with experts (sizes "
                                  "dividing model.moe.num_experts; never for a dense model).")
    # Short rows gain nothing from a split but K/V traffic, and each cp size is a meta pass more.
    context_parallel_from: int | None = Field(
        2048, ge=2, description="Consider context parallelism (each sequence split over a cp axis, ring attention; "
        "not with a pipeline) when train.seq_len is at least this; null = never.")
    show: int = Field(20, ge=1, description="Rows of the ranking the dry run prints (all are in auto_plan.json).")
    prune: bool = Field(True, description="Skip the layouts whose lower bound exceeds the best time found (they cannot "
                        "win); false predicts every valid layout, so the whole ranking is exact (slower).")


class ParallelConfig(LayoutSection):
    auto: AutoPlanConfig | None = Field(
        None, description="Let the planner choose the layout: `+parallel=auto mesh=[N]` gives only this section; "
        "the fastest layout predicted to fit replaces it before validation, and keeps it as a record of the search.")
    pipeline: PipelineConfig | None = Field(None, description="Pipeline parallelism; null = none.")
    context_parallel: ContextParallelConfig | None = Field(
        None, description="Context parallelism: each sequence split over a mesh axis, attention exact (built-in and "
        "Hugging Face Llama-family models); null = every rank holds whole sequences.")
    expert_parallel: ExpertParallelConfig | None = Field(
        None, description="Expert parallelism for a mixture-of-experts model (`+parallel=ep`): experts Shard(0) over "
        "this axis, tokens moved to them and back by all-to-all; null = none.")
    grid_parallel: GridParallelConfig | None = Field(
        None, description="2-D / 2.5-D tensor parallelism over a q x q grid (`+parallel=tp2d`, `+parallel=tp2p5d`); "
        "null = none.")
    tensor_parallel_3d: Cube3DConfig | None = Field(
        None, description="Colossal-AI's 3-D tensor parallelism (`+parallel=tp3d`): the blocks' Linears, norms and "
        "activations split over a q x q x q cube of mesh axes; null = none.")
    activation_checkpointing: ActivationCheckpointing = Field(
        "none", description="Recompute activations in backward: none; full = whole blocks (every block, or every "
        "n-th with activation_checkpointing_every), only each block's input kept; selective = Megatron-LM's "
        "selective recomputation: only the attention core (the scaled-dot-product attention: q, k, v kept, its "
        "internals and output recomputed) of every block.")
    activation_checkpointing_every: int = Field(1, ge=1, description="With `full`: checkpoint every n-th block "
                                                "(1 = every block; 2 = the 2nd, 4th, ...). Only with full.")


# ------------------------------------------------------------------------------ mesh


def flat_ranks(ranks: list[Any]) -> list[int]:
    """A list or a nested (2-D) list of ranks, row-major."""
    return [r for row in ranks for r in (row if isinstance(row, list) else [row])]

MeshValue = list[int] | list[Any]
