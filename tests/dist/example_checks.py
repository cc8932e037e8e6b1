"""What each rank checks for the seed examples in ``conf/examples/`` (see ``test_examples.py``).

The parent composes each example with Hydra (``+examples=<name>``) and hands the plain dict to
every rank of one launch; a rank validates it with the trainer's own ``validate_config``, builds
the model exactly as the trainer does (``trainer.run.build.build_parallel_model``) and reports, as
JSON, per example:

* ``params``: each parameter's DTensor placements per mesh axis (``{}`` for a plain tensor),
  local shard shape, whether the gathered values equal the one-device initialisation, ``slices``
  (``[start, stop]`` per dim of the global tensor the local shard covers; all of it for a plain
  tensor) and ``local_values_match`` (the local shard equals those slices of the one-device value);
* ``rank_id``: the rank's id under the example's explicit ``mesh`` ids (its torch rank without);
* ``stages``: per stage module, the local shape of its input and, captured by a forward hook
  that runs *before* the engine's own output redistribution, the placements, local and global
  shape of the raw output (a ``Partial`` output shows here), plus the shape handed on afterwards;
  recorded in the first forward of training (the first micro-batch under a pipeline);
* ``partial``: for tensor-parallel examples, the model placed with ``apply_placements`` and a
  ``layouts`` entry ``{"": {output: {mp: Partial}}}``: the output stays a ``Partial`` DTensor
  whose sum over ranks equals the one-device output;
* ``losses``: 3 steps of ``trainer.run.loop.train`` (null tracker and progress), as rank 0 logs them.

Configs passed as ``builds`` (not seeds: FSDP's uneven and strided shards, which no seed has)
are only built in the same launch and report ``params``.

    results = launch(world_size=2, configs={"pp_gpipe_tiny": raw_dict}, out_dir=tmp_path,
                     builds={"fsdp_uneven": other_raw_dict})
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp
from torch.distributed.tensor import DTensor
from dist_harness import group_store, join_group, run_checks_and_exit
from trainer.launch.processes import START_METHOD, worker_server
from timing import scaled

WORLD_TIMEOUT_S = 300  # idle-host seconds, scaled in the parent: a loaded machine stalls a rank for long



def launch(*, world_size: int, configs: dict[str, dict], out_dir: Path, builds: dict[str, dict] | None = None) -> list[dict]:
    """Run :func:`check_example` for every ``{name: composed config dict}`` of ``configs`` and
    :func:`check_build` for every one of ``builds`` on ``world_size`` gloo processes (one process
    group for all of them); the per-rank result dicts."""
    out_dir.mkdir(parents=True, exist_ok=True)
    with worker_server(), group_store() as port:  # forked from one server that imported torch and the trainer
        mp.start_processes(_entry, args=(world_size, port, configs, str(out_dir), builds or {}, scaled(WORLD_TIMEOUT_S)),
                           nprocs=world_size, join=True, start_method=START_METHOD)
    return [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(world_size)]


def _entry(rank: int, world_size: int, port: int, configs: dict[str, dict], out_dir: str,
           builds: dict[str, dict], timeout_s: float) -> None:
    torch.set_num_threads(1)  # up to 8 ranks on 2 cores
    join_group(rank, world_size, port, timeout_s)

    run_checks_and_exit([(name, lambda raw=raw: check_example(raw)) for name, raw in configs.items()]
                        + [(name, lambda raw=raw: check_build(raw)) for name, raw in builds.items()],
                        rank=rank, out_dir=out_dir)


# ------------------------------------------------------------------------------ checks


def _placements(t: torch.Tensor) -> dict[str, str]:
    """``{axis name: placement}`` of a DTensor (``_StridedShard`` reads as ``Shard(d)``), ``{}`` if plain."""
    if not isinstance(t, DTensor):
        return {}
    names = t.device_mesh.mesh_dim_names
    out = {}
    for i, p in enumerate(t.placements):
        dim = getattr(p, "dim", None)
        out[names[i]] = f"Shard({dim})" if dim is not None else ("Partial" if p.is_partial() else "Replicate")
    return out


def _local_shape(t: torch.Tensor) -> list[int]:
    return list(t.to_local().shape if isinstance(t, DTensor) else t.shape)


def _probe_stages(pm) -> list[dict]:
    """Hooks on every stage module: raw output (before the engine's output hook) and handed-on output."""
    records = []
    for index, part in zip(pm.stage_indices, pm.model_parts):
        rec: dict[str, Any] = {"stage": index}

        def pre(_m, args, rec=rec):
            rec.setdefault("input_local", _local_shape(args[0]))

        def raw(_m, _args, out, rec=rec):
            rec.setdefault("raw_output", {"placements": _placements(out), "local": _local_shape(out),
                                          "global": list(out.shape), "dtensor": isinstance(out, DTensor)})

        def handed(_m, _args, out, rec=rec):
            rec.setdefault("output", {"dtensor": isinstance(out, DTensor), "local": _local_shape(out)})

        part.register_forward_pre_hook(pre, prepend=True)
        # prepend: before distribute_module's output_fn (which redistributes and unwraps) and FSDP's hooks
        part.register_forward_hook(raw, prepend=True)
        part.register_forward_hook(handed)
        records.append(rec)
    return records


def _partial_output(cfg) -> dict | None:
    """Tensor-parallel examples without pipeline/dp: keep the output Partial via ``layouts``."""
    from parallel.mesh import build_mesh
    from parallel.placements import parse_placement
    from parallel.plan.resolve import resolve_plan
    from parallel.plan.spec import LayoutSpec
    from parallel.sharding.tensor_parallel import apply_placements
    from trainer.models import build_model

    par = cfg.parallel
    if par.pipeline is not None or par.data_parallel is not None or not par.placements:
        return None
    model = build_model(cfg.model, seed=cfg.train.seed)
    x = torch.randn(cfg.train.global_batch_size, cfg.model.in_features, generator=torch.Generator().manual_seed(3))
    expected = model(x).detach()
    mesh = build_mesh(cfg.mesh_shape, par.dims)
    axis = par.dims[0]
    placements = resolve_plan(par, cfg.mesh, model).placements
    apply_placements(model, mesh, placements=placements, layouts={"": LayoutSpec(output={axis: parse_placement("Partial")})})
    out = model(x)
    full = out.full_tensor().detach()
    return {"placements": _placements(out), "local": _local_shape(out),
            "sum_rel_err": float((full - expected).abs().max() / expected.abs().max())}


def check_example(raw: dict) -> dict:
    """Everything one rank reports about one example (see the module docstring).

    ``trainer.run.loop.train`` builds its model with ``build_parallel_model``; it is wrapped here so
    the very model that trains is inspected (at initialisation) and probed (its first forward),
    and the example is built once.
    """
    import trainer.run.loop as loop
    from parallel.config import mesh_rank_ids
    from parallel.mesh import rank_id_of
    from trainer.run.metrics import NullProgress
    from trainer.tracking.tracker import NullTracker
    from trainer.validate.checks import validate_config

    cfg = validate_config(raw)
    report: dict[str, Any] = {}
    build = loop.build_parallel_model

    def build_and_inspect(run_cfg, device, **options):  # options: the plan the loop was given, if any
        pm = build(run_cfg, device, **options)
        report.update(params=_param_report(pm, run_cfg), stages=_probe_stages(pm), dp_size=pm.dp_size)
        return pm

    loop.build_parallel_model = build_and_inspect
    try:
        losses = loop.train(cfg, tracker=NullTracker(), progress=NullProgress()).losses
    finally:
        loop.build_parallel_model = build
    return {**report, "losses": losses, "partial": _partial_output(cfg),
            "rank_id": rank_id_of(mesh_rank_ids(cfg.mesh), torch.distributed.get_rank())}


def check_build(raw: dict) -> dict:
    """A config that is only built, not trained (the data-parallel sharding the seeds lack:
    FSDP's uneven and strided shards): ``params`` as :func:`check_example` reports them."""
    from trainer.run.build import build_parallel_model
    from trainer.validate.checks import validate_config

    cfg = validate_config(raw)
    return {"params": _param_report(build_parallel_model(cfg, torch.device("cpu")), cfg)}


def _param_report(pm, cfg) -> dict:
    """Per parameter of this rank: placements, local shape, slices and whether the values are one device's."""
    from trainer.models import build_model

    full = dict(build_model(cfg.model, seed=cfg.train.seed).named_parameters())
    params = {}
    for fqn, p in pm.named_parameters():
        value = p.full_tensor() if isinstance(p, DTensor) else p
        params[fqn] = {"placements": _placements(p), "local": _local_shape(p),
                       "values_match": bool(torch.equal(value.detach(), full[fqn].detach())),
                       **_local_slices(p, full[fqn])}
    return params


def _local_slices(param: torch.Tensor, full: torch.Tensor) -> dict:
    """Which slices of the global tensor this rank's shard covers (a plain tensor: all of it),
    and whether it holds their values."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    if isinstance(param, DTensor):
        shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
    else:
        shape, offset = tuple(param.shape), (0,) * param.dim()
    slices = [[start, start + size] for start, size in zip(offset, shape)]
    expected = full[tuple(slice(a, b) for a, b in slices)]
    local = param.to_local() if isinstance(param, DTensor) else param
    return {"slices": slices, "local_values_match": bool(torch.equal(local.detach(), expected.detach()))}
