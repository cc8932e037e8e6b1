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
from typing import Annotated, Any, Literal, Union

from pydantic import Field, ValidationInfo, field_validator

from parallel.config import MeshValue, ParallelConfig, Precision, mesh_shape_of
from parallel.config import Section as _Section
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
from trainer.config.tracking_schema import TrackingConfig

# ----------------------------------------------------------------------------- model


class RopeScaling(_Section):
    """Llama 3's rotary frequency adjustment (Llama 3.1 / 3.2 checkpoints): a long-context model
    trained at ``original_max_position_embeddings`` keeps its short wavelengths, stretches its long
    ones by ``factor``, and blends the two in between."""

    type: Literal["llama3"] = Field("llama3", description="The scaling rule; only Llama 3's (`llama3`) is built in.")
    factor: float = Field(8.0, ge=1, description="Wavelengths longer than original_max_position_embeddings / "
                          "low_freq_factor are multiplied by this (their frequencies divided).")
    low_freq_factor: float = Field(1.0, gt=0, description="original_max_position_embeddings / low_freq_factor is the "
                                   "wavelength above which the full factor applies.")
    high_freq_factor: float = Field(4.0, gt=0, description="original_max_position_embeddings / high_freq_factor is "
                                    "the wavelength below which frequencies are kept; between the two they are blended.")
    original_max_position_embeddings: int = Field(8192, ge=1, description="The context length the model was "
                                                  "pre-trained at, before the context was extended.")

    @field_validator("high_freq_factor")
    @classmethod
    def _above_low_freq_factor(cls, value: float, info: ValidationInfo) -> float:
        low = info.data.get("low_freq_factor")  # absent when it failed its own check
        if low is not None and value <= low:
            raise ValueError(f"must be greater than low_freq_factor {low} (the two bound the band of blended "
                             "wavelengths; Llama 3.1 uses 1 and 4)")
        return value


class LoRAConfig(_Section):
    """Low-rank adapters (LoRA, as PEFT defines them): each targeted Linear computes
    ``W x + (alpha / rank) * B A dropout(x)``, with ``A [rank, in]`` (kaiming-uniform) and ``B [out, rank]``
    (zeros) trained and every other weight of the model frozen (no gradient, no optimizer state)."""

    rank: int = Field(0, ge=0, description="Rank r of the adapters; 0 = no LoRA (full fine-tuning). Must be at most "
                      "min(in, out) of every targeted Linear.")
    alpha: float | None = Field(None, gt=0, description="LoRA alpha: the update is scaled by alpha / rank (PEFT's "
                                "lora_alpha). null = 2 * rank (a scaling of 2).")
    dropout: float = Field(0.0, ge=0, lt=1, description="Dropout on the adapters' input (PEFT's lora_dropout); 0 = none. "
                           "A run with dropout draws other random numbers on every layout, so its losses are not one "
                           "device's.")
    targets: list[str] | None = Field(
        None, description="Globs over the model's module names choosing the Linears that get adapters (`*` crosses "
        "dots, as in parallel.placements), e.g. `[\"layers.*.attn.w[qv]\"]` or `[\"model.layers.*.self_attn.*_proj\"]`. "
        "null = every attention and MLP projection (q, k, v, o, gate, up, down). A glob matching no Linear is refused.")
    save_base: bool = Field(
        False, description="Checkpoints also hold the frozen base weights. false = adapters (and their optimizer "
        "state) only; the base comes again from model.path, train.init_from or train.seed on resume and export.")

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    @property
    def scaling(self) -> float:
        """alpha / rank: the factor of the adapters' update."""
        return (self.alpha if self.alpha is not None else 2.0 * self.rank) / self.rank


class LlamaConfig(_Section):
    """A Llama-style decoder; the defaults are the tiny `gpt_debug` preset (trains in minutes on a CPU)."""

    arch: Literal["llama"] = Field("llama", description="Decoder-only transformer (RMSNorm, RoPE, GQA, SwiGLU).")
    # No ceilings on widths here: the memory prediction refuses a model that does not fit
    # (launch.memory_budget_gb) and the validator refuses more than MAX_LAYERS blocks before building.
    dim: int = Field(64, ge=1, description="Model (embedding) width.")
    n_layers: int = Field(4, ge=1, description="Number of transformer blocks, `layers.0` .. `layers.<n-1>`.")
    n_heads: int = Field(4, ge=1, description="Attention heads; `dim` must divide by it.")
    n_kv_heads: int | None = Field(2, ge=1, description="Key/value heads (grouped-query attention); null = n_heads.")
    vocab_size: int = Field(256, ge=2, description="Vocabulary size; 256 for the byte-level tokenizer.")
    ffn_hidden_dim: int = Field(172, ge=1, description="Hidden width of the SwiGLU MLP (w1, w3: dim -> hidden; w2: back).")
    # CPU and memory: the rotary table and the activation prediction grow with it (1e10 took the validator
    # 23 s); 2**24 is above the longest published context (10M tokens).
    max_seq_len: int = Field(256, ge=1, le=2**24, description="Longest sequence the rotary table covers; at most "
                             "16777216.")
    norm_eps: float = Field(1e-5, gt=0, description="RMSNorm epsilon.")
    rope_theta: float = Field(10000.0, gt=0, description="RoPE base frequency.")
    init_std: float = Field(0.02, gt=0, description="Std of the normal initialisation of linear and embedding weights.")
    head_dim: int | None = Field(None, ge=2, description="Width of one attention head; null = dim / n_heads.")
    qkv_bias: bool = Field(False, description="Biases on the q/k/v projections (Qwen2).")
    qk_norm: bool = Field(False, description="RMSNorm of each query and key head before RoPE (Qwen3).")
    rope_scaling: RopeScaling | None = Field(
        None, description="Llama 3.x rotary frequency scaling (type, factor, low_freq_factor, high_freq_factor, "
        "original_max_position_embeddings); null = plain RoPE.")
    lora: LoRAConfig = Field(default_factory=LoRAConfig, description="Low-rank adapters (`model.lora.rank=16` turns "
                             "them on); rank 0 = full fine-tuning.")

    @property
    def num_kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def head_width(self) -> int:
        """One attention head's width: ``head_dim``, or ``dim // n_heads`` when that is null."""
        return self.head_dim or self.dim // self.n_heads


class MLPConfig(_Section):
    arch: Literal["mlp"] = Field("mlp", description="Two raw matmuls, y = (x @ w0) @ w1, weights stored [in, out].")
    in_features: int = Field(1024, ge=1, description="Rows of w0 (input width).")
    hidden_features: int = Field(4096, ge=1, description="Columns of w0 and rows of w1.")
    out_features: int = Field(1024, ge=1, description="Columns of w1 (output width).")
    activation: Literal["none", "relu", "gelu"] = Field(
        "relu", description="Applied between the two matmuls; `none` gives the seeds' plain matmul chain."
    )
    init_std: float = Field(0.02, gt=0, description="Std of the normal initialisation of w0 and w1.")


class HFModelConfig(_Section):
    arch: Literal["hf"] = Field("hf", description="A Hugging Face causal LM from a local directory (Llama family: "
                                "Llama, Mistral, Qwen2, Qwen3).")
    path: str | None = Field(
        None,
        description="Directory with the model's config.json (model_type llama, mistral, qwen2 or qwen3), plus *.safetensors weights "
        "when present (random init from the config when absent). Nothing is downloaded.",
    )
    lora: LoRAConfig = Field(default_factory=LoRAConfig, description="Low-rank adapters (`model.lora.rank=16` turns "
                             "them on); rank 0 = full fine-tuning.")


class CustomModelConfig(_Section):
    arch: Literal["custom"] = Field("custom", description="Your own nn.Module, from a builder function.")
    builder: str | None = Field(
        None, description="module:function returning the nn.Module (CLI only: REST refuses import paths).")
    name: str | None = Field(
        None, description="A model an installed package registers under the `meshflow.models` entry points "
        "(usable from the CLI and REST).")
    # None, not {}: Hydra replaces a null node by `model.kwargs={...}`, but will not add keys to an empty one.
    kwargs: dict[str, Any] | None = Field(None, description="Keyword arguments of the builder (null = none).")
    loss: Literal["lm", "mse"] = Field(
        "lm", description="lm: cross-entropy of logits [B, T, vocab] (text, synthetic data); mse: regression.")


# The members of each tagged union, once: Hydra's `<tag>_defaults` and `--help` list them from here.
MODEL_SECTIONS = (LlamaConfig, MLPConfig, HFModelConfig, CustomModelConfig)
ModelConfig = Annotated[Union[MODEL_SECTIONS], Field(discriminator="arch")]

# ------------------------------------------------------------------------------ data: trainer.config.data_schema


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


# ----------------------------------------------------------------------------- train


class CheckpointConfig(_Section):
    dir: str = Field("checkpoints", min_length=1, description="Directory holding `step_<n>` checkpoint folders.")
    every: int = Field(0, ge=0, description="Save every N steps; 0 saves never (except `save_final`).")
    # Disk: each checkpoint is the whole model and optimizer state. Nobody keeps more than 1000 of them;
    # a run that needs its whole history saves less often.
    keep: int = Field(3, ge=1, le=1000, description="Keep the newest K checkpoints, delete older ones; at most 1000.")
    resume: str = Field("none", min_length=1, description="`none`, `auto` (latest in dir, if any) or a checkpoint path.")
    save_final: bool = Field(True, description="Also save after the last step: what `python -m trainer.export` and "
                             "`python -m trainer.generate` read, and the MLflow run's `model/` artifact. false: only `every`'s saves.")


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
    # Time: a forward and backward per accumulation step; no batch splits into more than 65536 of them usefully.
    grad_accum: int = Field(1, ge=1, le=65536, description="Gradient-accumulation steps per optimizer step; at most "
                            "65536.")
    log_every: int = Field(10, ge=1, description="Log metrics every N steps.")
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
        "each, the same ones every time); fewer when the split is smaller; at most 10000.")
    precision: Precision = Field(
        "fp32", description="fp32, or bf16: bf16 compute with fp32 master weights, optimizer state and gradient "
        "reduction (FSDP2's mixed-precision policy under data parallelism, autocast otherwise).")
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig, description="Checkpointing.")
    init_from: str | None = Field(
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
                                  "rendezvous before it gives up and says which nodes are missing; at most 86400 (a day).")
    local_addr: str | None = Field(
        None, description="The address the other hosts reach this one at (its workers' store and gloo listen there). "
        "null = this host's name, as torch's launcher resolves it.")
    # Time: every restart starts all workers again from the last checkpoint; a job failing 100 times will not pass.
    max_restarts: int = Field(0, ge=0, le=100, description="Times torch's elastic agent restarts failed workers; "
                              "at most 100.")
    log_dir: str | None = Field(
        "logs", description="Where the workers' per-rank log files go (torch elastic's log options): "
        "`<log_dir>/<run>/attempt_<n>/<rank>/stdout.log` and `stderr.log`, also uploaded to the MLflow run's "
        "`logs/`; rank 0's output and every rank's errors still show on the console. null = a temporary "
        "directory, removed after the upload.")
    memory_budget_gb: float | None = Field(
        None, gt=0, description="Memory per worker a run may use (GiB); a config predicted to need more is refused "
        "before any worker starts. null = the GPU's memory, or 90% of the host's memory shared by its workers.")
    unmap_freed_memory: bool = Field(
        False, description="CPU workers (glibc): give every allocation from 128 KiB up pages of its own, returned to the "
        "system when freed, so freed tensors leave no heap holes resident. The peak drops toward the live tensors "
        "(a third less per rank on fsdp [8] of a 1B model), for more CPU time in page faults. false = glibc's "
        "dynamic threshold.")


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
    parallel: ParallelConfig | None = Field(None, description="How the model is spread over the mesh; null = one device.")
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
    def world_size(self) -> int:
        return math.prod(self.mesh_shape)

    def axis_size(self, name: str) -> int:
        """Size of the mesh axis called ``name`` (1 when there is no such axis)."""
        if self.parallel is None or name not in self.parallel.dims:
            return 1
        return self.mesh_shape[self.parallel.dims.index(name)]

    @property
    def dp_size(self) -> int:
        """Data-parallel ranks the batch is split over (with per-stage layouts: the lanes)."""
        if (stages := self.stages) and stages[0].ranks:
            return len(stages[0].rank_list)
        dp = self.parallel.data_parallel if self.parallel else None
        return math.prod(self.axis_size(n) for n in dp.dim_names) if dp else 1

    @property
    def pp_size(self) -> int:
        if stages := self.stages:
            return len(stages)
        pp = self.parallel.pipeline if self.parallel else None
        return self.axis_size(pp.dim) if pp else 1

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
