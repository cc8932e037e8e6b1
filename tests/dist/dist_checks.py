"""Checks that run inside the worker processes of one launch (see ``dist_harness``).

Each check takes ``rank``/``world_size`` and returns a JSON-able dict; the parent test compares
it with a single-device reference computed by :func:`reference_run` in the parent process.
Presets are read from ``conf/parallel/*.yaml`` with ``yaml.safe_load`` and validated by the
trainer's own ``ParallelConfig`` (tests may import the trainer; the ``parallel`` package may not).
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
import yaml
from torch import nn
from torch.distributed.tensor import DTensor, Partial
from torch.utils._python_dispatch import TorchDispatchMode

from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

from parallel.engine import ParallelModel, parallelize
from parallel.pipeline.order import compute_order
from parallel.pipeline.timeline import TimelineRecorder
from parallel.mesh import build_mesh
from parallel.plan.resolve import resolve_plan
from parallel.plan.spec import LayoutSpec
from parallel.placements import parse_placement
from parallel.sharding.tensor_parallel import apply_placements
from parallel.config import ParallelConfig, mesh_shape_of
from trainer.config.schema import LlamaConfig, MLPConfig
from trainer.models import build_model, loss_fn_for, meta_initializer
from sequence_checks import saved_bytes_check

REPO = Path(__file__).resolve().parents[2]
STEPS, GLOBAL_BATCH, SEQ_LEN, LR, GRAD_CLIP = 5, 8, 32, 1e-3, 1.0
MLP_CFG = MLPConfig(in_features=16, hidden_features=32, out_features=8, activation="relu")


# ------------------------------------------------------------------------------ data


def llama_cfg() -> LlamaConfig:
    from trainer.config.compose import compose_dict

    return LlamaConfig(**compose_dict(["model=gpt_debug"])["model"])


def batches(model_cfg) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``STEPS`` global batches (inputs, targets) from a fixed seeded tensor."""
    g = torch.Generator().manual_seed(1234)
    if isinstance(model_cfg, LlamaConfig):
        tokens = torch.randint(0, model_cfg.vocab_size, (STEPS, GLOBAL_BATCH, SEQ_LEN + 1), generator=g)
        return [(t[:, :-1], t[:, 1:]) for t in tokens]
    x = torch.randn(STEPS, GLOBAL_BATCH, model_cfg.in_features, generator=g)
    y = torch.randn(STEPS, GLOBAL_BATCH, model_cfg.out_features, generator=g)
    return list(zip(x, y))


def make_optimizer(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(list(params), lr=LR, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, foreach=False)


def reference_run(model_cfg, *, precision: str = "fp32", decoder=None, keep_model: bool = False, loss_fn=None,
                  targets_of=None) -> dict:
    """Single device, no engine: the losses and pre-clip gradient norms every mesh must match
    (``precision="bf16"``: under bf16 autocast, fp32 weights). ``decoder``: the shape of a Hugging
    Face model's batches; ``keep_model``: the trained model under ``"model"``."""
    model = build_model(model_cfg, seed=0)
    optimizer, loss_fn = make_optimizer(model.parameters()), loss_fn or loss_fn_for(model_cfg)
    losses, norms = [], []
    for inputs, targets in batches(decoder or model_cfg):
        targets = targets_of(targets) if targets_of is not None else targets
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
            loss = loss_fn(model(inputs), targets)
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), GRAD_CLIP)))
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    with torch.no_grad():  # forward only, after training: what ParallelModel.evaluate must give
        inputs, targets = batches(decoder or model_cfg)[0]
        targets = targets_of(targets) if targets_of is not None else targets
        eval_loss = loss_fn(model(inputs), targets).item()
    return {"losses": losses, "grad_norms": norms, "eval_loss": eval_loss, **({"model": model} if keep_model else {})}


# --------------------------------------------------------------------------- presets


def load_preset(name: str, **pipeline_update) -> tuple[list, ParallelConfig]:
    """``(mesh, ParallelConfig)`` of ``conf/parallel/<name>.yaml``, pipeline fields overridden."""
    raw = yaml.safe_load((REPO / f"conf/parallel/{name}.yaml").read_text())
    parallel = raw["parallel"]
    if pipeline_update:
        parallel = {**parallel, "pipeline": {**parallel["pipeline"], **pipeline_update}}
    return raw["mesh"], ParallelConfig.model_validate(parallel)


CPU = torch.device("cpu")


def parallelize_preset(model: nn.Module, mesh: list | None, par: ParallelConfig | None, *, precision: str = "fp32",
                       **overrides) -> ParallelModel:
    """The trainer's road: resolve the plan of ``par`` (fields replaced by ``overrides``), then
    parallelize; a model on the meta device is initialised shard by shard after sharding."""
    if par is not None and overrides:
        par = par.model_copy(update=overrides)
    init = meta_initializer(model, seed=0) if any(p.is_meta for p in model.parameters()) else None
    return parallelize(model, resolve_plan(par, mesh, model), device=CPU, init=init, precision=precision)


def train(pm: ParallelModel, model_cfg, *, grad_accum: int = 1, loss_fn=None, targets_of=None) -> dict:
    """``STEPS`` optimizer steps on this rank's dp share (in ``grad_accum`` pieces, as the
    trainer's loop does); losses as every rank sees them. The last step is recorded by a
    :class:`TimelineRecorder`, as the trainer's loop records its last steps: ``timeline`` holds
    this rank's actions, ``pipeline_order`` the schedule's compute order per pp rank."""
    # zero1: the optimizer's state sharded over dp, as the trainer's build_optimizer does (other modes: as made)
    optimizer, loss_fn = pm.shard_optimizer(make_optimizer(pm.parameters())), loss_fn or loss_fn_for(model_cfg)
    losses, norms = [], []
    recorder = TimelineRecorder(pm)
    for step, (inputs, targets) in enumerate(batches(model_cfg), start=1):
        targets = targets_of(targets) if targets_of is not None else targets
        per = inputs.shape[0] // pm.dp_size
        share = slice(pm.dp_rank * per, (pm.dp_rank + 1) * per)
        loss = None
        with recorder.step(step, record=step == STEPS):
            for x, y in zip(inputs[share].chunk(grad_accum), targets[share].chunk(grad_accum)):
                piece = pm.forward_backward(x, y, loss_fn, loss_scale=1.0 / grad_accum)
                if piece is not None:
                    loss = piece / grad_accum if loss is None else loss + piece / grad_accum
            with recorder.mark("optimizer"):
                norms.append(pm.clip_grad_norm_(GRAD_CLIP))
                optimizer.step()
                optimizer.zero_grad()
        losses.append(pm.reduce_loss(loss))
    timeline = {"timeline": recorder.events,
                "pipeline_order": compute_order(pm.schedule.pipeline_order) if pm.schedule is not None else None,
                "pp_rank": pipeline_rank(pm)}
    inputs, targets = batches(model_cfg)[0]
    targets = targets_of(targets) if targets_of is not None else targets
    per = inputs.shape[0] // pm.dp_size
    share = slice(pm.dp_rank * per, (pm.dp_rank + 1) * per)
    try:
        eval_loss = pm.reduce_loss(pm.evaluate(inputs[share], targets[share], loss_fn))
    except NotImplementedError:  # ZBV: no forward-only pass in torch (refused with a validation split)
        eval_loss = None
    return {"losses": losses, "grad_norms": norms, "eval_loss": eval_loss, **timeline}


def pipeline_rank(pm: ParallelModel) -> int | None:
    """This rank's position in its pipeline (the key of its row in ``pipeline_order``)."""
    if pm.schedule is None:
        return None
    from parallel.pipeline.timeline import pipeline_stages

    return pipeline_stages(pm.schedule)[0].group_rank


# ------------------------------------------------------------------------ placements


def _chunk(size: int, parts: int, index: int) -> int:
    """Length of ``torch.chunk``'s piece ``index`` (what DTensor and FSDP2 keep locally)."""
    per = math.ceil(size / parts)
    return max(0, min(per, size - index * per))


def placement_globs(par: ParallelConfig) -> dict:
    """The config's placement globs: the built-in Llama's named plan (the same globs the presets
    wrote out before presets named plans), then the explicit ones, which override it."""
    globs = {}
    if par.tensor_parallel is not None:
        model = build_model(llama_cfg(), device="meta")
        placements, _ = model.parallel_plan(
            par.tensor_parallel.plan, axis=par.tensor_parallel.dim, sequence_parallel=par.tensor_parallel.sequence_parallel)
        if par.tensor_parallel.loss_parallel:  # the head column-parallel, the embedding's rows split alike
            axis = par.tensor_parallel.dim  # (gpt_debug's vocabulary divides by 2)
            placements = {**placements, **model.vocab_parallel_embedding(axis=axis), **model.vocab_parallel_plan(axis=axis)[0]}
        globs = {glob: {a: parse_placement(p) for a, p in axes.items()} for glob, axes in placements.items()}
    return {**globs, **par.placements}


def expected_layout(fqn: str, shape, par: ParallelConfig, mesh_shape, coordinate) -> tuple[dict, list]:
    """``({axis: "Shard(d)"}, local shape)`` the config asks for: the placements' shards on their
    axes, then FSDP's dim-0 shard of that over the dp (shard) axis."""
    from fnmatch import fnmatchcase

    order: list[tuple[str, int]] = []
    for glob, axes in placement_globs(par).items():
        if fnmatchcase(fqn, glob):
            order += [(a, p.dim % len(shape)) for a in par.dims for p in [axes.get(a)] if p is not None and p.is_shard]
    dp = par.data_parallel
    if dp is not None and dp.mode in ("fsdp", "zero2", "hsdp"):
        order.append((dp.dim_names[-1], 0))
    local = list(shape)
    for axis, dim in order:
        i = par.dims.index(axis)
        local[dim] = _chunk(local[dim], mesh_shape[i], coordinate[i])
    return {a: f"Shard({d})" for a, d in order}, local


def actual_layout(param: torch.Tensor) -> tuple[dict, list]:
    if not isinstance(param, DTensor):
        return {}, list(param.shape)
    names = param.device_mesh.mesh_dim_names
    # _StridedShard (FSDP over an already tp-sharded dim) is a Shard of the same dim.
    axes = {names[i]: f"Shard({pl.dim})" for i, pl in enumerate(param.placements) if getattr(pl, "dim", None) is not None}
    return axes, list(param.to_local().shape)


def check_placements(pm: ParallelModel, par: ParallelConfig, mesh_shape, model_cfg) -> list[str]:
    """Every parameter: placements and local shape as the config says, and the values (gathered)
    equal the single-device initial values."""
    full = dict(build_model(model_cfg, seed=0).named_parameters())
    coordinate = pm.mesh.get_coordinate()
    errors = []
    for fqn, param in pm.named_parameters():
        fqn = fqn.replace("_checkpoint_wrapped_module.", "")
        want = expected_layout(fqn, full[fqn].shape, par, mesh_shape, coordinate)
        got = actual_layout(param)
        if want != got:
            errors.append(f"{fqn}: expected {want}, got {got}")
        value = param.full_tensor() if isinstance(param, DTensor) else param
        if not torch.equal(value.detach(), full[fqn].detach()):
            errors.append(f"{fqn}: values differ from the single-device init")
    return errors


# ---------------------------------------------------------------------------- checks


def preset_check(name: str | tuple[list, dict], *, grad_accum: int = 1, precision: str = "fp32", **pipeline_update):
    """Parity, placements and FQNs of a preset by name, or of an inline ``(mesh, parallel dict)``."""

    def check(*, rank: int, world_size: int) -> dict:
        if isinstance(name, str):
            mesh, par = load_preset(name, **pipeline_update)
        else:
            mesh, par = name[0], ParallelConfig.model_validate(name[1])
        cfg = llama_cfg()
        pm = parallelize_preset(build_model(cfg, device="meta"), mesh, par, precision=precision)
        errors = check_placements(pm, par, mesh_shape_of(mesh), cfg)
        probe = _probe_norm_input(pm)
        linear_dtypes: set[str] = set()
        for module in pm.model_parts[0].modules():
            if isinstance(module, nn.Linear):
                module.register_forward_hook(lambda _m, _i, out: linear_dtypes.add(str(out.dtype)))
        fqns = sorted(n.replace("_checkpoint_wrapped_module.", "") for n, _ in pm.named_parameters())
        return {**train(pm, cfg, grad_accum=grad_accum), "placement_errors": errors, "fqns": fqns, "report": pm.placement_report,
                "param_dtypes": sorted({str(p.dtype) for p in pm.parameters()}),
                "linear_output_dtypes": sorted(linear_dtypes),
                "stages": pm.stage_indices, "norm_input_local_shape": probe,
                "mesh_ranks": pm.mesh.mesh.tolist(), "coordinate": pm.mesh.get_coordinate()}

    return check


def _probe_norm_input(pm: ParallelModel) -> list:
    """Records the local shape of the first block's attn_norm input (sequence parallel: T / tp)."""
    seen: list = []
    for part in pm.model_parts:
        for name, mod in part.named_modules():
            if name.endswith("attn_norm"):
                def hook(_m, args, _out):
                    x = args[0]
                    if not seen:
                        seen.extend((x.to_local() if isinstance(x, DTensor) else x).shape)
                mod.register_forward_hook(hook)
                return seen
    return seen


def ac_check(name: str, mode: str, every: int = 1):
    """Parity under activation checkpointing; ``wrapped``: the blocks ``full`` wraps, ``cores``: the attention
    modules ``selective`` recomputes, ``attention_calls``: scaled-dot-product attention calls per training step
    (a block's core runs twice under selective: forward, and again in backward)."""

    def check(*, rank: int, world_size: int) -> dict:
        mesh, par = load_preset(name)
        cfg = llama_cfg()
        pm = parallelize_preset(build_model(cfg, device="meta"), mesh, par, activation_checkpointing=mode,
                                activation_checkpointing_every=every)
        modules = dict(pm.model_parts[0].named_modules())
        wrapped = sorted(n for n, m in modules.items() if isinstance(m, CheckpointWrapper))
        cores = sorted(n for n, m in modules.items() if getattr(m, "recompute_attention_core", False))
        with AttentionCalls() as calls:
            inputs, targets = batches(cfg)[0]
            pm.forward_backward(inputs[:2], targets[:2], loss_fn_for(cfg))
        for p in pm.parameters():
            p.grad = None
        # Whatever saved-tensor hooks the step pushed (checkpointing's, sequence parallelism's) are popped again,
        # also where checkpointing's recomputation stops early by raising inside a block.
        trained = train(pm, cfg)
        hooks_left = torch._C._autograd._top_saved_tensors_default_hooks(True) is not None
        return {**trained, "wrapped": wrapped, "cores": cores, "attention_calls": calls.count, "hooks_left": hooks_left}

    return check


class AttentionCalls(TorchDispatchMode):
    """Counts the attention kernel's forward calls while active, backward's recomputation included (a
    dispatch mode: a torch function mode is not active where checkpointing recomputes in backward)."""

    count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default:
            self.count += 1
        return func(*args, **(kwargs or {}))


def loss_parallel_check(name: str | tuple[list, dict], *, chunk_tokens: int | None = None, masked: bool = False,
                        **overrides):
    """A preset (or inline layout) with loss parallel, trained on the plain LM loss (``chunk_tokens``: chunked)
    or, ``masked``, on the chat data's masked loss (``TargetMeanLoss``) over targets with every third one -100;
    ``logits``: the head's output on this rank (a DTensor's placements and local shape)."""

    def check(*, rank: int, world_size: int) -> dict:
        mesh, par = load_preset(name) if isinstance(name, str) else (name[0], ParallelConfig.model_validate(name[1]))
        cfg = llama_cfg()
        pm = parallelize_preset(build_model(cfg, device="meta"), mesh, par, **overrides)
        seen: dict = {}
        for part in pm.model_parts:
            head = getattr(part, "output", None)
            if head is not None:
                head.register_forward_hook(lambda _m, _a, out: seen.update(
                    placements=[str(p) for p in out.placements], local=list(out.to_local().shape))
                    if isinstance(out, DTensor) else seen.update(placements=[], local=list(out.shape)))
        loss_fn = masked_loss(chunk_tokens) if masked else loss_fn_for(cfg, chunk_tokens=chunk_tokens)
        fqns = sorted(n for n, _ in pm.named_parameters())
        return {**train(pm, cfg, loss_fn=loss_fn, targets_of=masked_targets if masked else None),
                "logits": seen, "loss_parallel": pm.loss_parallel, "fqns": fqns}

    return check


def masked_targets(targets: torch.Tensor) -> torch.Tensor:
    """Targets with every third position -100 (a chat row's prompt tokens: no loss there)."""
    out = targets.clone()
    out[:, ::3] = -100
    return out


def masked_loss(chunk_tokens: int | None = None):
    """The chat data's loss over :func:`masked_targets`: summed over the targets that count, divided by the
    global batch's count of them (the same for every batch here: 2/3 of each row, rounded up)."""
    from trainer.models import TargetMeanLoss

    loss = TargetMeanLoss(chunk_tokens)
    loss.tokens_per_row = float(SEQ_LEN - len(range(0, SEQ_LEN, 3)))
    return loss


MLP_PLACEMENTS = {"w0": {"tp": "Shard(1)"}, "w1": {"tp": "Shard(0)"}}


def mlp_tp_check(*, rank: int, world_size: int) -> dict:
    """The seeds' MLP: raw w0 Shard(1), w1 Shard(0) via DTensor propagation; trains to parity,
    and a Partial output layout leaves the output Partial with the right sum."""
    par = ParallelConfig.model_validate({"dims": ["tp"], "placements": MLP_PLACEMENTS})
    pm = parallelize_preset(build_model(MLP_CFG, device="meta"), [2], par)
    shapes = {n: list(p.to_local().shape) for n, p in pm.named_parameters()}
    result = {**train(pm, MLP_CFG), "report": pm.placement_report, "local_shapes": shapes}

    mesh = build_mesh([2], ["tp"])
    model = build_model(MLP_CFG, seed=0)
    x = torch.randn(4, MLP_CFG.in_features, generator=torch.Generator().manual_seed(7))
    expected = model(x)
    placements = {fqn: {axis: parse_placement(p) for axis, p in axes.items()} for fqn, axes in MLP_PLACEMENTS.items()}
    apply_placements(model, mesh, placements=placements, layouts={"": LayoutSpec(output={"tp": parse_placement("Partial")})})
    out = model(x)
    result["partial_output"] = isinstance(out, DTensor) and out.placements == (Partial(),)
    result["partial_sum_max_abs_err"] = float((out.full_tensor() - expected).abs().max().detach())
    return result


def mlp_pp_check(*, rank: int, world_size: int) -> dict:
    """The MLP cut between its raw parameters: stage FQNs are w0 and w1."""
    par = ParallelConfig.model_validate(
        {"dims": ["pp"], "pipeline": {"dim": "pp", "schedule": "GPipe", "microbatches": 2, "boundaries": ["w1"]}}
    )
    pm = parallelize_preset(build_model(MLP_CFG, device="meta"), [2], par)
    fqns = sorted(n for n, _ in pm.named_parameters())
    return {**train(pm, MLP_CFG), "fqns": fqns}


def single_device_check(*, rank: int, world_size: int) -> dict:
    """``parallelize`` with mesh (1,) is a plain model (run on every rank, no communication)."""
    cfg = llama_cfg()
    pm = parallelize_preset(build_model(cfg, seed=0), None, None)
    return {**train(pm, cfg), "mesh_is_none": pm.mesh is None}


HSDP = {"dims": ["dp_replicate", "dp_shard"], "data_parallel": {"dim": ["dp_replicate", "dp_shard"], "mode": "hsdp"}}
# Explicit rank ids in an order torch's sorted process groups could not follow as a mesh: they
# label devices, and the engine's mesh is still torch ranks 0..7 row-major.
RANK_IDS_MESH = [[1, 3, 5, 7], [0, 2, 4, 6]]

PP_TP = {  # the head's stage tensor-parallel: the last stage's loss on vocabulary shards
    "dims": ["pp", "tp"], "tensor_parallel": {"dim": "tp"},
    "pipeline": {"dim": "pp", "schedule": "1F1B", "microbatches": 2, "boundaries": "auto"},
}
FSDP_PP = {  # FSDP inside pipeline stages, with gradient accumulation on top
    "dims": ["dp", "pp"],
    "data_parallel": {"dim": "dp", "mode": "fsdp"},
    "pipeline": {"dim": "pp", "schedule": "1F1B", "microbatches": 2, "boundaries": "auto"},
}
SP = {"dim": "tp", "plan": "megatron", "sequence_parallel": True}
TWO_D_SP = {"dims": ["dp", "tp"], "data_parallel": {"dim": "dp", "mode": "fsdp"}, "tensor_parallel": SP}
PP_INTERLEAVED_TP_SP = {**PP_TP, "tensor_parallel": SP,
                        "pipeline": {**PP_TP["pipeline"], "schedule": "Interleaved1F1B", "stages_per_rank": 2}}
THREE_D_SP_AC = {  # every layout sequence parallelism meets at once: FSDP, a pipeline, checkpointed blocks
    "dims": ["dp", "pp", "tp"], "data_parallel": {"dim": "dp", "mode": "fsdp"}, "tensor_parallel": SP,
    "pipeline": {"dim": "pp", "schedule": "1F1B", "microbatches": 4, "boundaries": "auto"},
    "activation_checkpointing": "full",
}


def comm_check(preset: str):
    """Collectives of one tp forward+backward, and of the update after it (clip + AdamW step),
    counted by DTensor's CommDebugMode."""

    def check(*, rank: int, world_size: int) -> dict:
        from torch.distributed.tensor.debug import CommDebugMode

        mesh, par = load_preset(preset)
        cfg = llama_cfg()
        pm = parallelize_preset(build_model(cfg, device="meta"), mesh, par)
        optimizer = make_optimizer(pm.parameters())
        inputs, targets = batches(cfg)[0]
        with CommDebugMode() as step_comm:
            pm.forward_backward(inputs, targets, loss_fn_for(cfg))
        with CommDebugMode() as update_comm:
            pm.clip_grad_norm_(1.0)
            optimizer.step()
        return {"counts": {str(op): n for op, n in step_comm.get_comm_counts().items()},
                "update_counts": {str(op): n for op, n in update_comm.get_comm_counts().items()}}

    return check


def hf_logits_check(*, rank: int, world_size: int) -> dict:
    """A Hugging Face Llama and a Qwen2 loaded from safetensors into fsdp x tp (the 2d preset, by
    the model's megatron plan in Hugging Face's names): their logits are transformers' own."""
    import os

    from transformers import AutoModelForCausalLM

    from trainer.config.schema import HFModelConfig
    from trainer.models.hf import build_hf_model, load_hf_sharded

    out = {}
    # Qwen2: q/k/v biases, split with their weights' rows. Qwen3 (per-head q/k norms, refused under
    # tensor-parallel attention) on hsdp.
    for kind, preset in (("llama", "2d"), ("qwen2", "2d"), ("qwen3", "hsdp")):
        path = os.environ[f"MESHFLOW_TEST_{kind.upper()}_DIR"]  # written by the parent test
        mesh, par = load_preset(preset)
        # The trainer's road: random init, shard, then each rank reads its slices of the safetensors.
        pm = parallelize_preset(build_hf_model(HFModelConfig(path=path), device="meta"), mesh, par)
        load_hf_sharded(pm.model_parts, path)
        tokens = batches(llama_cfg())[0][0]
        with torch.no_grad():
            ours = pm.model_parts[0](tokens)
            ours = ours.full_tensor() if isinstance(ours, DTensor) else ours  # loss parallel: vocabulary shards
            theirs = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()(tokens).logits
        out[kind] = {"max_abs_diff": float((ours - theirs).abs().max()), "report": pm.placement_report}
        if kind == "llama":  # train.init_from's road: each rank reads its blocks of one safetensors file
            from trainer.export.weights import load_weights

            pp_tp = ParallelConfig.model_validate({"dims": ["pp", "tp"], "tensor_parallel": {"dim": "tp"},
                                                   "pipeline": {"dim": "pp", "microbatches": 2}})
            pm = parallelize_preset(build_hf_model(HFModelConfig(path=path), device="meta"), [2, 2], pp_tp)
            load_weights(pm.model_parts, os.path.join(path, "model.safetensors"))
            full = {n: p.full_tensor() if isinstance(p, DTensor) else p.detach() for n, p in pm.named_parameters()}
            theirs_state = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).state_dict()
            out["init_from_pp_tp_max_abs_diff"] = max(float((full[n] - theirs_state[n]).abs().max()) for n in full)
            out["init_from_pp_tp_params"] = len(full)
    return out


SUITES = {
    "two_rank": [
        ("single_device", single_device_check),
        ("dp", preset_check("dp")),
        ("fsdp", preset_check("fsdp")),
        ("zero2", preset_check("zero2")),
        ("tp", preset_check("tp")),
        ("tp_sp", preset_check("tp_sp")),
        ("tp_comm", comm_check("tp")),
        ("tp_sp_comm", comm_check("tp_sp")),
        ("tp_sp_saved", saved_bytes_check),
        ("pp_GPipe", preset_check("pp", schedule="GPipe")),
        ("pp_1F1B", preset_check("pp", schedule="1F1B")),
        ("pp_Interleaved1F1B", preset_check("pp", schedule="Interleaved1F1B", stages_per_rank=2)),
        ("pp_InterleavedZeroBubble", preset_check("pp", schedule="InterleavedZeroBubble", stages_per_rank=2)),
        ("pp_ZBV", preset_check("pp", schedule="ZBV", stages_per_rank=2)),
        ("pp_1F1B_grad_accum", preset_check("pp", grad_accum=2, schedule="1F1B")),
        ("tp_sp_grad_accum", preset_check("tp_sp", grad_accum=2)),
        ("fsdp_ac_full", ac_check("fsdp", "full")),
        ("tp_sp_ac_full_every2", ac_check("tp_sp", "full", every=2)),
        ("tp_sp_ac_selective", ac_check("tp_sp", "selective")),
        ("tp_loss_parallel_off", preset_check(([2], {"dims": ["tp"], "tensor_parallel": {"dim": "tp",
                                                                                       "loss_parallel": False}}))),
        ("tp_sp_loss_parallel_chunked", loss_parallel_check("tp_sp", chunk_tokens=48)),
        ("tp_loss_parallel_masked", loss_parallel_check("tp", masked=True, chunk_tokens=100)),
        ("mlp_tp", mlp_tp_check),
        ("mlp_pp", mlp_pp_check),
        ("bf16_dp", preset_check("dp", precision="bf16")),
        ("bf16_fsdp", preset_check("fsdp", precision="bf16")),
        ("bf16_tp", preset_check("tp", precision="bf16")),
        ("bf16_pp", preset_check("pp", precision="bf16")),
        ("bf16_tp_sp", preset_check("tp_sp", precision="bf16")),
    ],
    "four_rank": [
        ("hsdp", preset_check("hsdp")),
        ("fsdp_pp_grad_accum", preset_check(([2, 2], FSDP_PP), grad_accum=2)),
        ("2d", preset_check("2d")),
        ("pp_tp_loss_parallel_masked", loss_parallel_check(([2, 2], PP_TP), masked=True, chunk_tokens=20)),
        ("bf16_2d", preset_check("2d", precision="bf16")),
        ("2d_sp", preset_check(([2, 2], TWO_D_SP))),
        ("pp_interleaved_tp_sp", preset_check(([2, 2], PP_INTERLEAVED_TP_SP))),
        ("hf_2d_logits", hf_logits_check),
    ],
    "eight_rank": [
        ("3d", preset_check("3d")),
        ("bf16_3d", preset_check("3d", precision="bf16")),
        ("3d_sp_ac", preset_check(([2, 2, 2], THREE_D_SP_AC))),
        ("hsdp_rank_ids", preset_check((RANK_IDS_MESH, HSDP))),
    ],
}
