"""Model-aware validation: the model is built on the meta device (no memory), the parallel
plan is resolved against it (:func:`parallel.plan.resolve.resolve_plan`: placements, layouts, stage
boundaries), and what only the trainer knows is checked beside it (head counts, model vs data,
the checkpoint to resume from)."""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Sequence

from torch import nn

from parallel.errors import ConfigError, ConfigIssue
from parallel.plan.resolve import resolve_plan
from parallel.plan.spec import ParallelPlan
from parallel.topology import MeshSpec
from parallel.sharding.activation_checkpointing import RECOMPUTE_CORE
from trainer.config.schema import CustomModelConfig, HFModelConfig, LlamaConfig, RunConfig
from trainer.data import chat_tokenizer_path
from trainer.data.text import resolve_root
from trainer.data.tokenizer import load_tokenizer
from trainer.models import decoder_config
from trainer.models.custom import CustomModelError, resolve_builder
from trainer.models.lora import LoRAError
from trainer.models.skeleton import meta_model
from trainer.planner.memory.budget import check_memory
from trainer.validate.context_checks import check_context_model
from trainer.validate.grid_checks import check_grid_model

log = logging.getLogger(__name__)

_DATA_FOR_ARCH = {"llama": ("text", "synthetic", "files", "chat"), "hf": ("text", "synthetic", "files", "chat"),
                  "mlp": ("regression",), "custom": ("text", "synthetic", "files", "chat")}
_ATTENTION_PROJECTIONS = {"wq", "wk", "wv", "wo", "q_proj", "k_proj", "v_proj", "o_proj"}
# Building on the meta device costs ~2 ms per block; a config (possibly sent over REST) asking
# for millions of blocks must get an answer, not hang the validator. Real models have < 200.
MAX_LAYERS = 1024


def check_against_model(cfg: RunConfig, *,
                        predict_memory: bool = True) -> tuple[ParallelPlan | None, list[ConfigIssue]]:
    """The config's plan for its model (None when the model cannot be planned) and every issue found.
    The data's issues and the model's plan are reported together; the plan waits only for the
    model's own issues (it cannot be built without them fixed), the memory prediction for every
    other issue (``predict_memory`` false: the caller found some; a prediction reads them all)."""
    issues = _check_model_data(cfg)
    if any(_blocks_the_build(issue.path) for issue in issues):
        return None, issues
    issues += _check_resume(cfg)
    try:
        model = meta_model(cfg.model)
    except CustomModelError as err:  # the user's builder raised on the meta device
        return None, issues + [ConfigIssue("model.kwargs", err.reason, err.fix)]
    except LoRAError as err:  # a target glob matching no Linear, a rank above a target's size
        return None, issues + [ConfigIssue(err.path, err.reason, err.fix)]
    except (RuntimeError, TypeError, ValueError, OverflowError) as err:  # e.g. sizes past int64
        first_line = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        return None, issues + [ConfigIssue("model", "its tensors are too large to build (torch says: "
                                                    f"{first_line[:120]})",
                                           "use model sizes whose tensors fit in memory (each dimension well "
                                           "below 2**31)")]
    plan_issues: list[ConfigIssue] = []
    try:
        decoder = decoder_config(cfg.model)
        plan = resolve_plan(cfg.parallel, cfg.mesh, model,
                            check_glob=lambda *glob: check_heads(decoder, *glob, sp=_sequence_parallel(cfg, glob[0])))
    except ConfigError as err:
        plan, plan_issues = None, err.issues
    issues += plan_issues + check_context_model(cfg, model) + check_grid_model(cfg, model)
    if cfg.parallel is not None:
        if cfg.parallel.activation_checkpointing != "none" and cfg.model.arch == "mlp":
            issues.append(ConfigIssue("parallel.activation_checkpointing",
                                      f"model {cfg.model.arch} has no transformer blocks to checkpoint",
                                      "set parallel.activation_checkpointing=none"))
        issues += _check_selective(cfg, model)
    if plan is not None:
        issues += _check_sequence_shards(cfg, plan)
    if plan is not None and predict_memory and not issues and not cfg.dry_run:  # a dry run prints it instead
        issues += _check_memory(cfg, plan)
    return (plan if not issues else None), issues


def _check_selective(cfg: RunConfig, model: nn.Module) -> list[ConfigIssue]:
    """``selective`` is Megatron's attention-core recomputation of every block; what it meant before
    (whole blocks, every n-th) is ``full`` with ``activation_checkpointing_every``."""
    par = cfg.parallel
    if par is None or par.activation_checkpointing != "selective" or cfg.model.arch == "mlp":
        return []
    if par.activation_checkpointing_every != 1:
        return [ConfigIssue("parallel.activation_checkpointing_every",
                            f"{par.activation_checkpointing_every} with activation_checkpointing=selective: selective "
                            "recomputes every block's attention core (Megatron-LM's selective recomputation); whole "
                            "blocks every n-th is full with activation_checkpointing_every",
                            "parallel.activation_checkpointing=full")]
    if not any(hasattr(m, RECOMPUTE_CORE) for m in model.modules()):
        return [ConfigIssue("parallel.activation_checkpointing", f"selective: model {type(model).__name__} has no "
                            "attention module offering its core for recomputation",
                            "parallel.activation_checkpointing=full")]
    if par.context_parallel is not None or any(s.context_parallel is not None for s in cfg.stages or ()):
        return [ConfigIssue("parallel.activation_checkpointing", "selective with context parallelism: recomputing "
                            "the ring's attention (its K/V exchange) in backward is not built",
                            "parallel.activation_checkpointing=full")]
    return []


def _blocks_the_build(path: str) -> bool:
    """An issue of the model's own shape (heads, layers, its config.json, its builder), or a pipeline
    the model cannot be cut into: the model is not built (nor planned) until it is fixed."""
    return path == "parallel.pipeline" or (path.startswith("model") and path not in ("model.vocab_size", "model.loss"))


def _check_sequence_shards(cfg: RunConfig, plan: ParallelPlan) -> list[ConfigIssue]:
    """Sequence parallelism (a layout input ``Shard(1)``: the sequence dim of ``[batch, seq, dim]``)
    splits every micro-batch's sequence evenly over its axis; an uneven split makes the ranks'
    all-gathers disagree in size, which gloo and nccl abort on."""
    if decoder_config(cfg.model) is None:
        return []
    axes = {axis for layout in plan.layouts.values() for axis, p in layout.input.items() if p.is_shard and p.dim == 1}
    issues = []
    cp = plan.cp_size  # each rank's share of a row is what sequence parallelism splits
    for axis in sorted(axes):
        size = plan.mesh.size(axis)
        if cp > 1 and cfg.train.seq_len % (2 * cp):
            continue  # reported as a cp split (trainer.validate.context_checks)
        if (cfg.train.seq_len // cp) % size:
            step = math.lcm(2 * cp, cp * size) if cp > 1 else size
            fit = step * max(1, round(cfg.train.seq_len / step))
            held = f" ({cfg.train.seq_len // cp} per cp rank)" if cp > 1 else ""
            issues.append(ConfigIssue("train.seq_len", f"{cfg.train.seq_len} tokens{held} do not split evenly over the "
                                      f"sequence-parallel axis {axis!r} of size {size}",
                                      f"use a multiple of {step}, e.g. train.seq_len={fit}"))
    return issues


def _check_memory(cfg: RunConfig, plan: ParallelPlan) -> list[ConfigIssue]:
    """Refuse a config predicted not to fit its per-rank memory budget (never starting a worker)."""
    try:
        return check_memory(cfg, plan)
    except Exception as err:  # noqa: BLE001 - not predicted is not refused (the layout may well train): said, loudly
        log.warning("memory NOT checked against the budget: the prediction failed (%s: %s); the run starts "
                    "unchecked (python -m trainer ... dry_run=true shows what was predicted)", type(err).__name__,
                    str(err).strip().splitlines()[0][:160] if str(err).strip() else "no message")
        return []


# Data kinds that read the user's own files: a fix naming them alone would be refused for want of files.
_FILE_KINDS = ("files", "chat")


def _data_fix(kinds: Sequence[str]) -> str:
    """``use data=text or data=synthetic``, then the kinds that need the user's files, with an example path."""
    ready = [k for k in kinds if k not in _FILE_KINDS]
    files = [k for k in kinds if k in _FILE_KINDS]
    fix = f"use data={' or data='.join(ready)}" if ready else "use"
    if files:
        fix += f"{',' if ready else ''} or your own files: " + ", ".join(
            f"data={k} 'data.paths=[/data/corpus/*.jsonl]'" for k in files)
        fix += " (chat data also needs data.tokenizer)" if "chat" in files else ""
    return fix


def _check_model_data(cfg: RunConfig) -> list[ConfigIssue]:
    d, t = cfg.data, cfg.train
    issues = []
    if d.kind not in _DATA_FOR_ARCH[cfg.model.arch]:
        issues.append(ConfigIssue("data.kind", f"model {cfg.model.arch} cannot train on {d.kind} data",
                                  _data_fix(_DATA_FOR_ARCH[cfg.model.arch])))
    has_val_split = bool(getattr(d, "val_fraction", 0) or getattr(d, "val_paths", None))
    if t.eval_every and not has_val_split:
        issues.append(ConfigIssue("train.eval_every", f"evaluates every {t.eval_every} steps, but data.kind: {d.kind} "
                                  "has no validation split", "set data.val_fraction (text, files) or data.val_paths "
                                  "(files), or train.eval_every=0"))
    if t.eval_at_start and not has_val_split:  # null (auto) without a split skips the evaluation quietly
        fix = ("add data.val_fraction=0.1, or set train.eval_at_start=false" if hasattr(d, "val_fraction") else
               f"set train.eval_at_start=false (data={d.kind} has no validation split; data=text and data=files take "
               "data.val_fraction)")
        issues.append(ConfigIssue("train.eval_at_start", f"evaluates before step 1, but data.kind: {d.kind} has no "
                                  "validation split", fix))
    pipeline = cfg.parallel.pipeline if cfg.parallel is not None else None
    if pipeline is not None and pipeline.schedule == "ZBV" and has_val_split:
        # torch 2.13's ZBV schedule cannot run forward-only (its V stages steal the backward input).
        issues.append(ConfigIssue("parallel.pipeline.schedule", "ZBV cannot evaluate the validation split "
                                  "(torch's V schedule has no forward-only pass)",
                                  "use parallel.pipeline.schedule=InterleavedZeroBubble, or drop "
                                  "data.val_fraction / val_paths"))
    data_vocab = None  # the tokenizer's id count, for data=files
    if d.kind == "text":
        try:
            resolve_root(d.root)
        except FileNotFoundError as err:
            reason = str(err).removeprefix("data.root: ").partition(" (")[0]
            issues.append(ConfigIssue("data.root", reason, "give a directory of text files, or data.root=stdlib "
                                                           "(the Python standard library)"))
    if d.kind == "files":
        file_issues, data_vocab = _check_files(d)
        issues += file_issues
    if d.kind == "chat":
        chat_issues, data_vocab = _check_chat(d, getattr(cfg.model, "path", None))
        issues += chat_issues
    issues += _check_packing(cfg)
    if isinstance(cfg.model, HFModelConfig):
        # optional: transformers, the hf extra
        from trainer.models.hf import HFModelError, model_dir, read_hf_config, sliding_window

        try:
            path = model_dir(cfg.model)
            m, _ = read_hf_config(path)
        except HFModelError as err:
            return issues + [ConfigIssue("model.path", err.reason, err.fix)]
        if (window := sliding_window(path)) is not None and t.seq_len > window:
            # Full attention equals the model's sliding-window attention only while a sequence fits the window.
            issues.append(ConfigIssue("train.seq_len", f"the model attends over a sliding window of {window} tokens "
                                      "(config.json sliding_window); attention here is full, which differs past it",
                                      f"train.seq_len={window}"))
        # The decoder's own checks below speak of config.json's values, reported at model.path.
        return issues + [ConfigIssue("model.path", f"(config.json) {i.path}: {i.reason}",
                                     i.fix) if i.path.startswith("model.")
                         else i for i in _check_decoder(m, d, t, data_vocab)]
    if isinstance(cfg.model, LlamaConfig):
        issues += _check_decoder(cfg.model, d, t, data_vocab)
    if isinstance(cfg.model, CustomModelConfig):
        if cfg.parallel is not None and cfg.parallel.pipeline is not None:
            issues.append(ConfigIssue("parallel.pipeline", "a custom module's forward cannot run as a pipeline stage "
                                      "(it would need to skip the pieces other stages hold)",
                                      "use data, tensor or sequence parallelism for a custom model"))
        want = "mse" if d.kind == "regression" else "lm"
        if cfg.model.loss != want:
            issues.append(ConfigIssue("model.loss", f"{d.kind} data is trained with the {want} loss, not "
                                                    f"{cfg.model.loss}",
                                      f"set model.loss={want}"))
        try:
            resolve_builder(cfg.model.builder, cfg.model.name)
        except CustomModelError as err:
            issues.append(ConfigIssue("model.name" if cfg.model.name else "model.builder", err.reason, err.fix))
    return issues


def _check_decoder(m: LlamaConfig, d, t, data_vocab: int | None = None) -> list[ConfigIssue]:
    """Checks of a decoder config against the data (``data_vocab``: the files' tokenizer's id
    count, when known) and the training shape."""
    issues = []
    if m.n_layers > MAX_LAYERS:
        issues.append(ConfigIssue("model.n_layers",
                                  f"{m.n_layers} blocks is more than the {MAX_LAYERS} this trainer supports",
                                  f"use n_layers <= {MAX_LAYERS}, e.g. model.n_layers={MAX_LAYERS}"))
    if m.head_dim is None and m.dim % m.n_heads:
        issues.append(ConfigIssue("model.n_heads", f"dim {m.dim} does not split into {m.n_heads} heads",
                                  "use an n_heads that divides model.dim, or set model.head_dim"))
    elif m.head_width % 2:
        issues.append(ConfigIssue("model.head_dim" if m.head_dim else "model.n_heads",
                                  f"head_dim {m.head_width} is odd; rotary embeddings pair dimensions",
                                  "choose an even head width (dim / n_heads, or model.head_dim)"))
    if m.n_heads % m.num_kv_heads:
        issues.append(ConfigIssue("model.n_kv_heads", f"{m.n_heads} query heads do not group over "
                                                      f"{m.num_kv_heads} kv heads",
                                  "use an n_kv_heads that divides n_heads"))
    if t.seq_len > m.max_seq_len:
        issues.append(ConfigIssue("train.seq_len", f"{t.seq_len} is longer than model.max_seq_len {m.max_seq_len}",
                                  f"use seq_len <= {m.max_seq_len}, e.g. train.seq_len={m.max_seq_len}, or raise "
                                  "model.max_seq_len"))
    if d.kind == "text" and m.vocab_size < 256:
        issues.append(ConfigIssue("model.vocab_size", f"byte-level text needs 256 token ids, got {m.vocab_size}",
                                  "set model.vocab_size=256"))
    if data_vocab and m.vocab_size < data_vocab:
        issues.append(ConfigIssue("model.vocab_size", f"the tokenizer ({d.tokenizer or 'bytes'}) has "
                                                      f"{data_vocab} token "
                                  f"ids, the model's embedding only {m.vocab_size}",
                                  f"use a model with vocab_size >= {data_vocab}, or its own tokenizer"))
    if d.kind == "synthetic" and d.num_symbols ** (d.order + 1) > 2**22:
        issues.append(ConfigIssue("data.num_symbols", f"the order-{d.order} transition table over {d.num_symbols} "
                                  f"symbols has {d.num_symbols ** (d.order + 1):,} entries (limit {2**22:,})",
                                  "use fewer symbols or a lower data.order"))
    if d.kind == "synthetic" and d.num_symbols > m.vocab_size:
        issues.append(ConfigIssue("data.num_symbols", f"{d.num_symbols} symbols exceed model.vocab_size {m.vocab_size}",
                                  f"use num_symbols <= vocab_size, e.g. data.num_symbols={m.vocab_size}"))
    return issues


def _sequence_parallel(cfg: RunConfig, where: str) -> str | None:
    """The override that turns off the named plan's sequence parallelism behind the glob at
    ``where`` (the run's plan, or a pipeline stage's own), or None when it is off."""
    par = cfg.parallel
    if par is None:
        return None
    stages = par.pipeline.stages if par.pipeline is not None else None
    if (stage := re.match(r"parallel\.pipeline\.stages\[(\d+)\]", where)) and stages is not None:
        tp, key = stages[int(stage.group(1))].tensor_parallel, f"parallel.pipeline.stages.{stage.group(1)}"
    else:
        tp, key = par.tensor_parallel, "parallel"
    if tp is None or not tp.sequence_parallel or ".tensor_parallel.plan[" not in where:
        return None
    return f"{key}.tensor_parallel.sequence_parallel=false"


def check_heads(m: LlamaConfig | None, where: str, axes, fqns: list[str], mesh: MeshSpec, *,
                 sp: str | None = None) -> list[ConfigIssue]:
    """Attention is split by heads: a sharding axis of an attention glob (of ``mesh``: the run's,
    or a pipeline stage's own) must divide the head counts. The fix replicates the attention
    (spelt out as an override by the plan), with ``sp``: and turns sequence parallelism off,
    which needs the attention split to gather its norm's output."""
    if m is None or not any(f.split(".")[-2] in _ATTENTION_PROJECTIONS for f in fqns):
        return []
    # The plan spells "... Replicate" out as the override replicating the glob (parallel.plan.layout).
    lead = f"{sp} (sequence parallelism needs the attention split) and " if sp else ""
    for axis, p in axes.items():
        n = mesh.size(axis)
        if not p.is_shard or n == 1:
            continue
        for what, heads in (("n_heads", m.n_heads), ("n_kv_heads", m.num_kv_heads)):
            if heads % n:
                return [ConfigIssue(f"{where}.{axis}",
                                    f"attention is split by heads: model.{what}={heads} over {axis} size {n} leaves "
                                    "ranks with partial heads",
                                    f"use a {axis} size dividing {math.gcd(m.n_heads, m.num_kv_heads)}, or "
                                    f"{lead}Replicate")]
    return []


def _check_files(d) -> tuple[list[ConfigIssue], int | None]:
    """Every path and glob matches a file, and the tokenizer loads (the corpus is not read here):
    ``(issues, the tokenizer's vocabulary size or None when it does not load)``."""
    issues, vocab = _check_file_lists(d, records_only=False), None
    try:
        vocab = load_tokenizer(d.tokenizer, d.eos_token).vocab_size
    except ConfigError as err:
        issues += err.issues
    return issues, vocab


def _check_file_lists(d, *, records_only: bool) -> list[ConfigIssue]:
    """Every path and glob of ``data.paths`` / ``data.val_paths`` matches files of one format (records,
    not plain text, when ``records_only``), and one validation split is asked for."""
    from trainer.data.files import expand_paths, file_format  # optional: datasets, the hf extra

    issues = []
    for key, paths in [("data.paths", d.paths)] + ([("data.val_paths", d.val_paths)] if d.val_paths else []):
        try:
            if file_format(expand_paths(paths, key), key) == "text" and records_only:
                issues.append(ConfigIssue(key, "names plain text files; chat data is records",
                                          "give jsonl, json or parquet files of records with a messages list"))
        except ConfigError as err:
            issues += err.issues
    if d.val_paths and d.val_fraction:
        issues.append(ConfigIssue("data.val_fraction", "is set as well as data.val_paths",
                                  "use one validation split: val_paths or val_fraction"))
    return issues


def _check_chat(d, model_path: str | None) -> tuple[list[ConfigIssue], int | None]:
    """The files exist, and the tokenizer loads with a chat template (the conversations are not
    read here): ``(issues, the tokenizer's id count or None)``."""
    from trainer.data.chat import load_chat_tokenizer  # optional: transformers, the hf extra

    issues, vocab = _check_file_lists(d, records_only=True), None
    try:
        vocab = len(load_chat_tokenizer(chat_tokenizer_path(d, model_path), d.template))
    except ConfigError as err:
        issues += err.issues
    return issues, vocab


def _check_packing(cfg: RunConfig) -> list[ConfigIssue]:
    """Packed documents (``data.packing``) reach the model as positions: the model must take them,
    and every stage must get its rows' positions."""
    if not getattr(cfg.data, "packing", False):
        return []
    if isinstance(cfg.model, CustomModelConfig):
        return [ConfigIssue("data.packing", "a custom module's forward takes no positions, so packed documents "
                            "would attend to each other", "data.packing=false")]
    pipeline = cfg.parallel.pipeline if cfg.parallel is not None else None
    if pipeline is not None and pipeline.stages:
        # Between stages of their own layouts a micro-batch travels as row blocks (parallel.pipeline.stage_io);
        # the positions would have to follow the same route, which they do not yet.
        return [ConfigIssue("data.packing", "stages with layouts of their own (parallel.pipeline.stages) do not pass "
                            "packed documents' positions between stages", "data.packing=false")]
    return []


def _check_resume(cfg: RunConfig) -> list[ConfigIssue]:
    """The checkpoint to resume from exists, is finished and was saved from this model."""
    ckpt = cfg.train.checkpoint
    if ckpt.resume == "none":
        return []
    # start-up: DCP (torch.distributed.checkpoint, which imports DTensor: about 2 s) only for a run that
    # resumes; validating any other config, and the control plane's start, go without it.
    from trainer.checkpoint.dcp import CheckpointError, check_model_config, read_extra, resolve_resume
    from trainer.checkpoint.safe_read import stored_keys

    try:
        path = resolve_resume(ckpt.resume, ckpt.dir)
        if path is not None:
            check_model_config(path, read_extra(path).get("model_config", {}), cfg.model.model_dump(mode="json"))
            stored_keys(path)  # its .metadata, by the restricted reader: a crafted one is refused here, not in a worker
    except CheckpointError as err:
        return [ConfigIssue("train.checkpoint.resume", err.reason.removeprefix("train.checkpoint.resume: "),
                            err.fix or "use train.checkpoint.resume=none or auto")]
    return []
