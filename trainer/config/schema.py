"""The whole run configuration as frozen pydantic models: the single source of truth.

Every default lives here, once: Hydra's base config is generated from these models
(:func:`trainer.config.compose.register_defaults`), and the YAML under ``conf/`` states only choices
and what a preset changes, so the CLI and a REST document get the same values. Hydra composes
YAML from ``conf/`` into a plain dict; :func:`trainer.validate.checks.validate_config`
turns that dict into a :class:`RunConfig` (or a :class:`parallel.errors.ConfigError` naming
every bad path). Every field carries a description: that is the user's documentation
(``python -m trainer --help`` prints it, the REST API's OpenAPI page shows it).
"""

from __future__ import annotations

import math
from typing import Literal

from pydantic import Field

from parallel.config import MeshValue, ParallelConfig, Precision
from parallel.config import Section as _Section
from parallel.topology import Topology, mesh_shape_of
from trainer.config.chat_data import ChatDataConfig  # noqa: F401 - re-exported with the other data sections
from trainer.config.data_schema import (  # noqa: F401 - re-exported: callers name every section from here
    DATA_SECTIONS,
    DataConfig,
    FilesDataConfig,
    RegressionDataConfig,
    SyntheticDataConfig,
    TextDataConfig,
)
from trainer.config.hardware import HardwareProfile
from trainer.config.path_text import PathText
from trainer.config.model_schema import (  # noqa: F401 - re-exported: callers name every section from here
    MODEL_SECTIONS,
    CustomModelConfig,
    HFModelConfig,
    LlamaConfig,
    LoRAConfig,
    MLPConfig,
    ModelConfig,
    MoEConfig,
    RopeScaling,
)
from trainer.config.slurm_schema import SlurmConfig
from trainer.config.tracking_schema import TrackingConfig

# ------------------------------------------------------------------ model, data: model_schema, data_schema

# ----------------------------------------------------------------------------- optim


DEFAULT_WARMUP_STEPS = 10  # neither warmup_steps nor warmup_fraction given


class OptimConfig(_Section):
    name: Literal["adamw"] = Field("adamw", description="Optimizer (torch.optim.AdamW).")
    lr: float = Field(3e-3, gt=0, description="Peak learning rate.")
    betas: tuple[float, float] = Field((0.9, 0.95), description="AdamW betas.")
    eps: float = Field(1e-8, gt=0, description="AdamW epsilon.")
    weight_decay: float = Field(0.1, ge=0, description="Decoupled weight decay.")
    warmup_steps: int | None = Field(
        None, ge=0, description="Linear warm-up steps from 0 to lr. null = optim.warmup_fraction of train.steps "
        "when that is set, else 10; a number here wins over warmup_fraction.")
    warmup_fraction: float | None = Field(
        None, ge=0, lt=1, description="Warm-up as a fraction of train.steps (rounded up to whole steps), used when "
        "optim.warmup_steps is null; null = 10 steps. The fine-tuning recipe (+recipe=finetune) sets 0.03.")
    schedule: Literal["cosine", "linear", "constant"] = Field("cosine", description="Decay after warm-up.")
    min_lr_ratio: float = Field(0.1, ge=0, le=1, description="Final lr as a fraction of lr (cosine, linear).")

    def warmup_steps_for(self, total_steps: int) -> int:
        """The warm-up steps of a ``total_steps`` run: warmup_steps, else warmup_fraction of it, else 10."""
        if self.warmup_steps is not None:
            return self.warmup_steps
        if self.warmup_fraction is not None:
            return math.ceil(round(self.warmup_fraction * total_steps, 9))  # round: 0.1 * 100 is 10.000000000000002
        return DEFAULT_WARMUP_STEPS


# -------------------------------------------------------------------------- tracking


# ----------------------------------------------------------------------------- train


class CheckpointConfig(_Section):
    dir: PathText = Field("checkpoints", min_length=1, description="Directory holding `step_<n>` checkpoint folders.")
    every: int = Field(0, ge=0, description="Save every N steps; 0 saves never (except `save_final`).")
    # Disk: each checkpoint is the whole model and optimizer state. Nobody keeps more than 1000 of them;
    # a run that needs its whole history saves less often.
    keep: int = Field(3, ge=1, le=1000, description="Keep the newest K checkpoints, delete older ones; at most 1000.")
    resume: PathText = Field("none", min_length=1,
                        description="`none`, `auto` (latest in dir, if any) or a checkpoint path.")
    save_final: bool = Field(True, description="Also save after the last step: what `python -m trainer.export` and "
                             "`python -m trainer.generate` read (the MLflow run's `model/` artifact is gathered "
                             "without it: tracking.log_model). false: only `every`'s saves.")


class TrainConfig(_Section):
    # Time: the longest published pre-training runs take ~1e6 optimizer steps; 1e8 is a century of 30 ms steps.
    steps: int = Field(100, ge=1, le=10**8, description="Optimizer steps; at most 100000000.")
    # Memory: the largest published batches are 65536 sequences (BERT with LAMB); 16x that.
    global_batch_size: int = Field(16, ge=1, le=2**20, description="Sequences per optimizer step, summed over "
                                   "data-parallel ranks; at most 1048576.")
    # CPU and memory: as model.max_seq_len.
    seq_len: int = Field(128, ge=1, le=2**24, description="Tokens per sequence; at most 16777216.")
    seed: int = Field(0, description="Seed of the initialisation and of the data order.")
    grad_clip: float | None = Field(1.0, gt=0, description="Clip the global gradient norm to this; null disables.")
    # 4096 tokens: a 128k vocabulary's chunk is 2 GiB of fp32 (and 4096 x 32k, 0.5 GiB), while a short row
    # (most tests, B x T <= 4096) is one chunk, computed exactly as before.
    loss_chunk_tokens: int | None = Field(
        4096, ge=0, description="The cross-entropy's tokens per chunk: each chunk's fp32 upcast and log-softmax exist "
        "only while it is computed and are recomputed in backward, so a micro-batch never holds its whole fp32 "
        "log-probabilities ([tokens, vocab]); same losses and gradients. 0 or null = the whole micro-batch at once.")
    # Time: a forward and backward per accumulation step; no batch splits into more than 65536 of them usefully.
    grad_accum: int = Field(1, ge=1, le=65536, description="Gradient-accumulation steps per optimizer step; at most "
                            "65536.")
    log_every: int = Field(10, ge=1, description="Log metrics every N steps: to MLflow, and a console step line "
                           "whose loss, grad_norm, tok/s and ms/step are means over the steps since the previous one.")
    # Time: a line at most every day still shows a run is alive; 0 prints one per step (cheap: one line).
    progress_every_s: float = Field(
        30, ge=0, le=86400, description="When stdout is not a terminal (a pipe, a file, a service's job log): a plain "
        "`progress:` line (steps done, loss, tok/s, eta) when this many seconds passed since the last console line; "
        "0 = after every step; at most 86400. A terminal shows a live progress bar instead.")
    print_config: bool = Field(
        True, description="Print the resolved config's differences from the defaults when the run starts (also "
        "logged to MLflow as config_changes.yaml, beside the whole config.yaml); false prints nothing.")
    eval_every: int = Field(
        0, ge=0, description="With a validation split (data.val_fraction or data.val_paths): evaluate every N steps "
        "and after the last step; 0 = after the last step only.")
    eval_at_start: bool | None = Field(
        None, description="With a validation split: evaluate before step 1 and log val_loss at the step the run starts "
        "from (0 unless resuming), a baseline for a fine-tune. null = on when weights are loaded (model=hf with "
        "safetensors in model.path, or train.init_from) and the run does not resume from a checkpoint; "
        "true needs a validation split (data.val_fraction or data.val_paths).")
    # Time: every evaluation runs them all; 10000 batches is a validation set larger than most training sets.
    eval_batches: int = Field(
        4, ge=1, le=10_000, description="Validation batches per evaluation (global_batch_size / grad_accum sequences "
        "each, the same ones every time); fewer when the split is smaller: each row counts once (the last batch "
        "padded with rows that count for nothing) and val_loss is the mean over their targets; at most 10000.")
    precision: Precision = Field(
        "fp32", description="fp32, or bf16: bf16 compute with fp32 master weights, optimizer state and gradient "
        "reduction (FSDP2's mixed-precision policy under data parallelism, autocast otherwise).")
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig, description="Checkpointing.")
    init_from: PathText | None = Field(
        None, description="Initialise the weights from a safetensors file (see `python -m trainer.export`) "
        "instead of from the seed; null = from the seed."
    )
    compile: bool = Field(
        False, description="torch.compile each transformer block (the whole model when it has no blocks, as the "
        "mlp arch), applied after tensor parallelism and activation checkpointing, before data parallelism. The "
        "first steps are slow (compilation); losses equal eager ones within fp32 rounding, and parameter and "
        "checkpoint names do not change, so checkpoints move between compiled and eager runs. On CPU Inductor "
        "needs a C++ compiler ($CXX, else g++).")


# ---------------------------------------------------------------------------- launch


class LaunchConfig(_Section):
    executor: Literal["local", "slurm"] = Field(
        "local", description="Where the workers run: `local` = started by this command on this host (each host of "
        "launch.nnodes its own command); `slurm` = an sbatch job this command writes, submits and follows "
        "(launch.slurm), one launcher per node of the allocation.")
    slurm: SlurmConfig = Field(default_factory=SlurmConfig, description="With launch.executor=slurm: what the job "
                               "asks Slurm for.")
    nnodes: int = Field(1, ge=1, description="Number of hosts; workers per host = world size / nnodes.")
    node_rank: int = Field(0, ge=0, description="This host's rank among nnodes.")
    rdzv_endpoint: str = Field("127.0.0.1:0", description="host:port of the c10d rendezvous; port 0 picks a free one "
                               "(one host only: with several, node 0 serves it on this port, which the others dial).")
    rdzv_id: str | None = Field(
        None, max_length=128, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$",
        description="The rendezvous id every node of a run shares (the control plane sets the job id). null = a fresh "
        "one per run on one host; with several hosts, a digest of the config all nodes have in common.")
    # Time: a node that waits holds its host; nodes start within minutes, and a day covers one queued behind others.
    rdzv_timeout_s: float = Field(300, gt=0, le=86400, description="Seconds a node waits for the others to join the "
                                  "rendezvous before it gives up and says which nodes are missing; at most "
                                  "86400 (a day).")
    local_addr: str | None = Field(
        None, description="The address the other hosts reach this one at (its workers' store and gloo listen there). "
        "null = this host's name, as torch's launcher resolves it.")
    # Time: every restart starts all workers again from the last checkpoint; a job failing 100 times will not pass.
    max_restarts: int = Field(0, ge=0, le=100, description="Times torch's elastic agent restarts failed workers; "
                              "at most 100.")
    log_dir: PathText | None = Field(
        "logs", description="Where the workers' per-rank log files go (torch elastic's log options): "
        "`<log_dir>/<run>/attempt_<n>/<rank>/stdout.log` and `stderr.log`, also uploaded to the MLflow run's "
        "`logs/`; rank 0's output and every rank's errors still show on the console. null = a temporary "
        "directory, removed after the upload.")
    memory_budget_gb: float | None = Field(
        None, gt=0, description="Memory per worker a run may use (GiB); a config predicted to need more is refused "
        "before any worker starts. null = the GPU's memory, or 90% of the host's memory shared by its workers.")
    unmap_freed_memory: bool = Field(
        False, description="CPU workers (glibc): give every allocation from 128 KiB up pages of its own, "
                           "returned to the system when freed, so freed tensors leave no heap holes resident. The peak "
                           "drops toward the live tensors (a third less per rank on fsdp [8] of a 1B model), for more "
                           "CPU time in page faults. false = glibc's dynamic threshold.")


# ------------------------------------------------------------------------------- run

class RunConfig(_Section):
    model: ModelConfig = Field(default_factory=LlamaConfig, description="The model to train.")
    data: DataConfig = Field(default_factory=TextDataConfig, description="The training data.")
    optim: OptimConfig = Field(default_factory=OptimConfig, description="Optimizer and LR schedule.")
    tracking: TrackingConfig = Field(default_factory=TrackingConfig, description="Experiment tracking.")
    train: TrainConfig = Field(default_factory=TrainConfig, description="The training loop.")
    mesh: MeshValue | None = Field(
        None,
        description="Device mesh: a shape, outermost first ([2,2,2]), or nested explicit rank ids in any order "
        "([[2,4,5],[0,1,3]], PaddlePaddle's ProcessMesh; one host only). A rank id names the device a worker runs on "
        "(cuda:<id>; on CPU the id-th allowed core, modulo their number); torch's rank is the position in the "
        "row-major flattened mesh, so the worker with id 2 above is torch rank 0 at mesh position [0,0]. "
        "null = one device.",
    )
    parallel: ParallelConfig | None = Field(None,
                                            description="How the model is spread over the mesh; null = one device.")
    launch: LaunchConfig = Field(default_factory=LaunchConfig, description="How workers are started.")
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="auto = cuda when available, else cpu.")
    hardware: HardwareProfile = Field(default_factory=HardwareProfile, description="What the dry run and "
                                      "+parallel=auto plan for: `hardware=<profile>` (conf/hardware/) on launch.nnodes "
                                      "nodes; `this_host` (the default) calibrates this machine.")
    dry_run: bool = Field(False, description="Plan only: print memory, traffic and the predicted step (and write "
                          "meshflow-plan/plan.json); train nothing. Exit 2 if a launch would refuse the config.")
    dry_run_exit_zero: bool = Field(False, description="With dry_run=true: exit 0 even when a launch would refuse it.")
    validate_only: bool = Field(False, description="Validate the config against the model, print the verdict, exit.")

    # -- derived views ---------------------------------------------------------------

    @property
    def mesh_shape(self) -> tuple[int, ...]:
        return mesh_shape_of(self.mesh)

    @property
    def topology(self) -> Topology:
        """The mesh and what each axis splits (before resolution: no expert modules or tensor-parallel axes);
        every size below is asked of it. Built on the first question and kept beside the fields (as a
        ``cached_property`` keeps its value: equality and dumps read fields only) with the ``mesh`` and
        ``parallel`` objects it was built from, so a copy given other values (``model_copy(update=...)``,
        which copies what is kept) builds its own."""
        kept = self.__dict__.get("_topology_of")
        if kept is None or kept[0] is not self.mesh or kept[1] is not self.parallel:
            kept = (self.mesh, self.parallel, Topology.of_config(self.mesh, self.parallel))
            self.__dict__["_topology_of"] = kept  # the frozen model's fields stay untouched
        return kept[2]

    @property
    def world_size(self) -> int:
        return self.topology.world_size

    def axis_size(self, name: str) -> int:
        """Size of the mesh axis called ``name`` (1 when there is no such axis)."""
        return self.topology.size(name)

    @property
    def dp_size(self) -> int:
        """Ranks the batch is split over: the data-parallel axes and the expert-parallel one (with
        per-stage layouts: the lanes)."""
        return self.topology.dp_size

    @property
    def pp_size(self) -> int:
        return self.topology.pp_size

    @property
    def stages(self) -> list | None:
        """``parallel.pipeline.stages`` (each stage its own ranks and layout), or None."""
        pp = self.parallel.pipeline if self.parallel else None
        return pp.stages if pp is not None else None

    @property
    def num_microbatches(self) -> int:
        return self.parallel.pipeline.microbatches if self.parallel and self.parallel.pipeline else 1

    @property
    def micro_batch_size(self) -> int:
        """Sequences in one forward of one rank: the global batch over accumulation steps, dp ranks
        and a pipeline's micro-batches (at least 1)."""
        t = self.train
        return max(1, t.global_batch_size // t.grad_accum // max(1, self.dp_size) // self.num_microbatches)
