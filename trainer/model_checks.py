"""Model-aware validation: the model is built on the meta device (no memory) and the
config's placements, layouts, stage boundaries and head counts are checked against it."""

from __future__ import annotations

import math
from fnmatch import fnmatchcase

from torch import nn

from parallel.pipeline import pipeline_units
from parallel.placements import PlacementSpec
from trainer.config import LlamaConfig, RunConfig
from trainer.errors import ConfigIssue, format_path

_DATA_FOR_ARCH = {"llama": ("text", "synthetic"), "mlp": ("regression",)}
# Building on the meta device costs ~2 ms per block; a config (possibly sent over REST) asking
# for millions of blocks must get an answer, not hang the validator. Real models have < 200.
MAX_LAYERS = 1024


def check_against_model(cfg: RunConfig) -> list[ConfigIssue]:
    from trainer.models import build_model

    issues = _check_model_data(cfg)
    if issues:
        return issues
    issues += _check_resume(cfg)
    try:
        model = build_model(cfg.model, device="meta")
    except (RuntimeError, TypeError, ValueError, OverflowError) as err:  # e.g. sizes past int64
        first_line = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        return [ConfigIssue("model", f"its tensors are too large to build (torch says: {first_line[:120]})",
                            "use model sizes whose tensors fit in memory (each dimension well below 2**31)")]
    if cfg.parallel is None:
        return issues
    issues += _check_placements(cfg, model)
    issues += _check_layouts(cfg, model)
    issues += _check_boundaries(cfg, model)
    if cfg.parallel.activation_checkpointing != "none" and not isinstance(cfg.model, LlamaConfig):
        issues.append(ConfigIssue("parallel.activation_checkpointing", f"model {cfg.model.arch} has no transformer blocks to checkpoint",
                                  "set activation_checkpointing: none"))
    return issues


def _check_model_data(cfg: RunConfig) -> list[ConfigIssue]:
    m, d, t = cfg.model, cfg.data, cfg.train
    issues = []
    if d.kind not in _DATA_FOR_ARCH[m.arch]:
        issues.append(ConfigIssue("data.kind", f"model {m.arch} cannot train on {d.kind} data",
                                  f"use data={' or data='.join(_DATA_FOR_ARCH[m.arch])}"))
    if isinstance(m, LlamaConfig):
        if m.n_layers > MAX_LAYERS:
            issues.append(ConfigIssue("model.n_layers",
                                      f"{m.n_layers} blocks is more than the {MAX_LAYERS} this trainer supports",
                                      f"use n_layers <= {MAX_LAYERS}"))
        if m.dim % m.n_heads:
            issues.append(ConfigIssue("model.n_heads", f"dim {m.dim} does not split into {m.n_heads} heads",
                                      "use an n_heads that divides model.dim"))
        elif (m.dim // m.n_heads) % 2:
            issues.append(ConfigIssue("model.n_heads", f"head_dim {m.dim // m.n_heads} is odd; rotary embeddings pair dimensions",
                                      "choose dim and n_heads so dim / n_heads is even"))
        if m.n_heads % m.num_kv_heads:
            issues.append(ConfigIssue("model.n_kv_heads", f"{m.n_heads} query heads do not group over {m.num_kv_heads} kv heads",
                                      "use an n_kv_heads that divides n_heads"))
        if t.seq_len > m.max_seq_len:
            issues.append(ConfigIssue("train.seq_len", f"{t.seq_len} is longer than model.max_seq_len {m.max_seq_len}",
                                      f"use seq_len <= {m.max_seq_len} or raise model.max_seq_len"))
        if d.kind == "text" and m.vocab_size < 256:
            issues.append(ConfigIssue("model.vocab_size", f"byte-level text needs 256 token ids, got {m.vocab_size}",
                                      "set model.vocab_size: 256"))
        if d.kind == "synthetic" and d.num_symbols ** (d.order + 1) > 2**22:
            issues.append(ConfigIssue("data.num_symbols", f"the order-{d.order} transition table over {d.num_symbols} "
                                      f"symbols has {d.num_symbols ** (d.order + 1):,} entries (limit {2**22:,})",
                                      "use fewer symbols or a lower data.order"))
        if d.kind == "synthetic" and d.num_symbols > m.vocab_size:
            issues.append(ConfigIssue("data.num_symbols", f"{d.num_symbols} symbols exceed model.vocab_size {m.vocab_size}",
                                      "use num_symbols <= vocab_size"))
    return issues


def _check_placements(cfg: RunConfig, model: nn.Module) -> list[ConfigIssue]:
    par = cfg.parallel
    params = dict(model.named_parameters())
    issues: list[ConfigIssue] = []
    owner: dict[str, str] = {}
    for glob, axes in par.placements.items():
        matched = [fqn for fqn in params if fnmatchcase(fqn, glob)]
        if not matched:
            issues.append(ConfigIssue(format_path("parallel", "placements", glob), "matches no parameter of the model",
                                      f"fix the glob; parameters look like {', '.join(list(params)[:4])}, ..."))
            continue
        for fqn in matched:
            if fqn in owner:
                issues.append(ConfigIssue(format_path("parallel", "placements", glob),
                                          f"parameter {fqn} is also matched by {owner[fqn]!r}",
                                          "make the globs disjoint so each parameter has one placement"))
            owner[fqn] = glob
        # A glob can match parameters of different shapes ("*", GQA's wq/wk): check each shape once.
        first_of_shape = {}
        for fqn in matched:
            first_of_shape.setdefault(tuple(params[fqn].shape), fqn)
        reported = set()
        for shape, fqn in first_of_shape.items():
            for issue in _check_shards(cfg, glob, axes, shape, fqn):
                if issue.path not in reported:  # one issue per (glob, axis) is enough to fix it
                    reported.add(issue.path)
                    issues.append(issue)
        issues += _check_heads(cfg, glob, axes, matched)
    return issues


def _check_shards(cfg: RunConfig, glob: str, axes: dict[str, PlacementSpec], shape, fqn: str) -> list[ConfigIssue]:
    issues = []
    per_dim: dict[int, list[str]] = {}
    for axis, p in axes.items():
        if not p.is_shard:
            continue
        path = format_path("parallel", "placements", glob, axis)
        dim = p.dim if p.dim >= 0 else p.dim + len(shape)
        if not 0 <= dim < len(shape):
            issues.append(ConfigIssue(path, f"{p} but parameter {fqn} has {len(shape)} dims (shape {list(shape)})",
                                      f"use {'Shard(0)' if len(shape) == 1 else f'Shard(0) .. Shard({len(shape) - 1})'}, "
                                      "or a glob matching only parameters with more dims"))
            continue
        per_dim.setdefault(dim, []).append(axis)
    for dim, names in per_dim.items():
        n = math.prod(cfg.axis_size(a) for a in names)
        size = shape[dim]
        if size % n:
            axis = names[-1]
            path = format_path("parallel", "placements", glob, axis)
            over = " x ".join(names)
            axes_note = f" ({over})" if len(names) > 1 else ""  # one axis: the path already names it
            issues.append(ConfigIssue(path, f"Shard({dim}) splits dim {dim} of size {size} over {n} ranks{axes_note}; "
                                      f"{size} is not divisible by {n}",
                                      f"use a {over} size dividing {size}, or Replicate"))
    return issues


def _check_heads(cfg: RunConfig, glob: str, axes: dict[str, PlacementSpec], fqns: list[str]) -> list[ConfigIssue]:
    m = cfg.model
    if not isinstance(m, LlamaConfig) or not any(f.split(".")[-2] in ("wq", "wk", "wv", "wo") for f in fqns):
        return []
    issues = []
    for axis, p in axes.items():
        n = cfg.axis_size(axis)
        if not p.is_shard or n == 1:
            continue
        for what, heads in (("n_heads", m.n_heads), ("n_kv_heads", m.num_kv_heads)):
            if heads % n:
                issues.append(ConfigIssue(format_path("parallel", "placements", glob, axis),
                                          f"attention is split by heads: model.{what}={heads} over {axis} size {n} leaves ranks with partial heads",
                                          f"use a {axis} size dividing {math.gcd(m.n_heads, m.num_kv_heads)}, or Replicate"))
                return issues
    return issues


def _check_layouts(cfg: RunConfig, model: nn.Module) -> list[ConfigIssue]:
    modules = [name for name, _ in model.named_modules() if name]
    return [
        ConfigIssue(format_path("parallel", "layouts", glob), "matches no module of the model",
                    f"fix the glob; modules look like {', '.join(modules[:4])}, ...")
        for glob in cfg.parallel.layouts
        if not any(fnmatchcase(name, glob) for name in modules)
    ]


def _check_boundaries(cfg: RunConfig, model: nn.Module) -> list[ConfigIssue]:
    pp = cfg.parallel.pipeline
    if pp is None:
        return []
    num_stages = cfg.pp_size * pp.stages_per_rank
    units = pipeline_units(model)
    if pp.boundaries == "auto":
        if num_stages > len(units):
            return [ConfigIssue("parallel.pipeline.boundaries", f"auto needs {num_stages} stages but the model has only "
                                f"{len(units)} pieces to cut between ({', '.join(units)})",
                                "use a smaller pp size or stages_per_rank, or a deeper model")]
        return []
    issues = []
    positions = []
    for i, name in enumerate(pp.boundaries):
        path = format_path("parallel", "pipeline", "boundaries", i)
        if name not in units:
            issues.append(ConfigIssue(path, f"{name!r} is not a top-level module of the model",
                                      f"use one of {', '.join(units[1:])}"))
        elif units.index(name) == 0:
            issues.append(ConfigIssue(path, f"{name!r} is the first module; it always begins stage 0",
                                      "list only the first module of every later stage"))
        else:
            positions.append(units.index(name))
    if not issues and positions != sorted(set(positions)):
        issues.append(ConfigIssue("parallel.pipeline.boundaries", f"{pp.boundaries} are not in forward order",
                                  "list each boundary once, in the order the model runs them"))
    if len(pp.boundaries) != num_stages - 1:
        issues.append(ConfigIssue("parallel.pipeline.boundaries",
                                  f"{len(pp.boundaries)} boundaries make {len(pp.boundaries) + 1} stages, but pp size "
                                  f"{cfg.pp_size} x stages_per_rank {pp.stages_per_rank} needs {num_stages}",
                                  f"give {num_stages - 1} boundar{'y' if num_stages == 2 else 'ies'}, or boundaries: auto"))
    return issues


def _check_resume(cfg: RunConfig) -> list[ConfigIssue]:
    """The checkpoint to resume from exists, is finished and was saved from this model."""
    from trainer.checkpoint import CheckpointError, check_model_config, read_extra, resolve_resume

    ckpt = cfg.train.checkpoint
    try:
        path = resolve_resume(ckpt.resume, ckpt.dir)
        if path is not None:
            check_model_config(path, read_extra(path).get("model_config", {}), cfg.model.model_dump(mode="json"))
    except CheckpointError as err:
        return [ConfigIssue("train.checkpoint.resume", err.reason.removeprefix("train.checkpoint.resume: "),
                            err.fix or "use train.checkpoint.resume=none or auto")]
    return []
