"""Colossal-AI's 3-D tensor parallelism (``+parallel=tp3d``) inside the workers of one launch (``dist_harness``).

* ``builtin``: gpt_debug on the cube [2, 2, 2] (heads split over c), the trainer's road from the preset;
* ``tied``: a SmolLM2-shaped Hugging Face Llama (9 heads over 3 kv heads, tied embeddings) on [2, 2, 2]:
  its heads do not divide by 2, so q/k/v are gathered over c for the attention core;
* ``dp``: ddp x a cube of side 1 ([2, 1, 1, 1]), the cube weights averaging their gradients over dp;
  ``dp_cube``: ddp x the cube [2, 2, 2, 2] (16 processes);
* ``bytes``: the bytes each rank sends in one forward and backward of gpt_debug on [2, 2, 2], by collective and
  axis (:class:`SentBytes`), against the analytic volume (the bench is ``tests/bench/bench_tp_grids.py``);
  the bytes of this rank's parameters and of what autograd keeps for backward, per kind.

The parent compares losses and gradient norms with one device (fp32, rel 1e-5).
"""

from __future__ import annotations

import os
from collections import defaultdict

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

from dist_checks import CPU, GLOBAL_BATCH, SEQ_LEN, batches, llama_cfg, load_preset, parallelize_preset, train
from trainer.models import build_model, loss_fn_for

TIED_ENV = "MESHFLOW_TEST_TIED_DIR"  # set by the parent test: the tied model's directory


def _summary(pm, result: dict) -> dict:
    placements = {name: [str(p) for p in param.placements] for name, param in pm.named_parameters()
                  if isinstance(param, DTensor)}
    return {"losses": result["losses"], "grad_norms": result["grad_norms"], "eval_loss": result["eval_loss"],
            "report": pm.placement_report, "placements": placements}


def builtin_check(*, rank: int, world_size: int) -> dict:
    mesh, par = load_preset("tp3d")
    cfg = llama_cfg()
    pm = parallelize_preset(build_model(cfg, device="meta"), mesh, par)
    return _summary(pm, train(pm, cfg))


def dp_check(*, rank: int, world_size: int) -> dict:
    """ddp over dp x the cube: [2, 1, 1, 1] on 2 ranks, [2, 2, 2, 2] on 16."""
    mesh, par = load_preset("tp3d_dp")
    cfg = llama_cfg()
    side = 2 if world_size == 16 else 1
    pm = parallelize_preset(build_model(cfg, device="meta"), [2, side, side, side], par)
    return _summary(pm, train(pm, cfg))


def tied_check(*, rank: int, world_size: int) -> dict:
    from trainer.config.compose import compose_dict
    from trainer.models import decoder_config
    from trainer.run.build import build_parallel_model
    from trainer.validate.checks import validate_config

    raw = compose_dict(["model=hf", f"model.path={os.environ[TIED_ENV]}", "data=synthetic", f"train.seq_len={SEQ_LEN}",
                        f"train.global_batch_size={GLOBAL_BATCH}", "+parallel=tp3d"])
    cfg = validate_config(raw)
    pm = build_parallel_model(cfg, CPU)
    return _summary(pm, train(pm, decoder_config(cfg.model)))


# ------------------------------------------------------------------------------ bytes


RING = {  # bytes a rank sends, per byte of the buffer counted, in a ring over n ranks
    "all_gather_into_tensor": lambda n: (n - 1) / n,   # counted: the gathered output
    "reduce_scatter_tensor": lambda n: (n - 1) / n,    # counted: the input
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "all_to_all_single": lambda n: (n - 1) / n,
}


class SentBytes(TorchDispatchMode):
    """Counts DTensor's functional collectives (``torch.ops._c10d_functional``) as the bytes this rank sends in
    a ring, by ``(op, axis)``; as ``torch.distributed.tensor.debug.CommDebugMode``, DTensor desugars first."""

    def __init__(self, axes: dict[tuple[int, ...], str]) -> None:
        super().__init__()
        self.axes = axes
        self.sent: dict[str, float] = defaultdict(float)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if any(t is DTensor for t in types):
            return NotImplemented
        name = func.overloadpacket.__name__
        if func.namespace == "_c10d_functional" and name in RING:
            from torch.distributed.distributed_c10d import _resolve_process_group

            values = dict(zip([a.name for a in func._schema.arguments], args)) | kwargs
            group = _resolve_process_group(values["group_name"])
            ranks = tuple(sorted(dist.get_process_group_ranks(group)))
            payload = values["input"]
            size = payload.numel() * payload.element_size() * (len(ranks) if name.startswith("all_gather") else 1)
            self.sent[f"{name}|{self.axes.get(ranks, str(ranks))}"] += size * RING[name](len(ranks))
        return func(*args, **kwargs)


def _axis_groups(mesh) -> dict[tuple[int, ...], str]:
    names = list(mesh.mesh_dim_names)
    return {tuple(sorted(dist.get_process_group_ranks(mesh.get_group(n)))): n for n in names}


def bytes_check(*, rank: int, world_size: int) -> dict:
    """One forward and backward of gpt_debug on the cube [2, 2, 2] (this rank's share of one batch): the bytes
    sent by collective and axis; this rank's parameter bytes (cube blocks and whole ones); the bytes autograd
    keeps for backward (parameters aside), by where they are saved: the cube's Linears, its norms, elsewhere."""
    mesh, par = load_preset("tp3d")
    cfg = llama_cfg()
    pm = parallelize_preset(build_model(cfg, device="meta"), mesh, par)
    model = pm.model_parts[0]
    inputs, targets = batches(cfg)[0]
    counter = SentBytes(_axis_groups(pm.mesh))
    params = {(p.to_local() if isinstance(p, DTensor) else p).untyped_storage()._cdata for p in pm.parameters()}
    saved: dict[str, int] = defaultdict(int)
    seen: set[int] = set()
    scope: list[str] = []
    for name, module in model.named_modules():
        if pm.placement_report.get(name) == "cube":
            kind = "linear" if isinstance(module, torch.nn.Linear) else "norm"
            module.register_forward_pre_hook(lambda _m, _a, kind=kind: scope.append(kind))
            module.register_forward_hook(lambda *_: scope.pop() and None)

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = (t.to_local() if isinstance(t, DTensor) else t).untyped_storage()
        if storage._cdata not in params and storage._cdata not in seen:
            seen.add(storage._cdata)
            saved[scope[-1] if scope else "other"] += storage.nbytes()
        return t

    with counter:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = loss_fn_for(cfg)(model(inputs), targets)
        loss.backward()
    cube = sum(p.to_local().numel() * 4 for p in pm.parameters() if isinstance(p, DTensor))
    whole = sum(p.numel() * 4 for p in pm.parameters() if not isinstance(p, DTensor))
    return {"sent": dict(counter.sent), "cube_param_bytes": cube, "whole_param_bytes": whole,
            "saved_bytes": dict(saved), "rows": inputs.shape[0], "seq_len": inputs.shape[1]}


SUITES = {
    "two_rank": [("dp", dp_check)],
    "eight_rank": [("builtin", builtin_check), ("tied", tied_check), ("bytes", bytes_check)],
    "sixteen_rank": [("dp_cube", dp_check)],
}
