"""Checks of the mixture-of-experts model ``gpt_moe`` on expert-parallel layouts, inside the worker
processes of one launch per world size (``dist_harness``).

Each check takes the trainer's road: the config composed from overrides and validated, the model
built on meta, sharded and given the seed's values per rank (:func:`build_parallel_model`), the
training loss with the balance loss added (:func:`with_aux_loss`); then ``STEPS`` steps on the
batches of ``dist_checks`` with AdamW, as the loop does. It reports the losses, the balance losses
and the gradient norms every rank sees, and where the experts' weights are.
"""

from __future__ import annotations

import os

import torch
from torch.distributed.tensor import DTensor

from dist_checks import GRAD_CLIP, batches, make_optimizer
from parallel.context import shard_sequence
from trainer.checkpoint.dcp import load_checkpoint, merged_module, save_checkpoint
from trainer.config.compose import compose_dict
from trainer.models import decoder_config, loss_fn_for
from trainer.models.moe import with_aux_loss
from trainer.run.build import build_parallel_model
from trainer.run.loop import train
from trainer.run import metrics
from trainer.run.metrics import MemoryMeter, NullProgress, _proc_status_kib
from trainer.tracking.tracker import NullTracker
from trainer.validate.checks import validate_config

OUT_ENV = "MESHFLOW_TEST_EXPERTS_OUT"  # set by the parent test
BASE = ["model=gpt_moe", "data=synthetic", "train.seq_len=32", "train.global_batch_size=8"]
# Wide experts (12.6M of the model's 12.7M parameters), a small batch: memory the experts' state decides.
MEMORY = ["model=gpt_moe", "model.moe.hidden_dim=2048", "data=synthetic", "train.seq_len=64", "train.global_batch_size=8",
          "train.steps=4", "tracking=none", "tracking.pictures=false", "train.checkpoint.save_final=false",
          "train.eval_at_start=false"]


def run_config(overrides: list[str]):
    """The validated RunConfig of ``gpt_moe`` under ``overrides`` (none: one device)."""
    return validate_config(compose_dict([*BASE, *overrides]))


def train_moe(cfg, *, save_after: int | None = None, save_under: str = "", resume: str | None = None,
              out_dir: str | None = None) -> dict:
    """``STEPS`` steps of ``cfg``'s model on this rank's share of each batch: the losses (balance
    loss included, with its weight), the unweighted balance losses and the pre-clip gradient norms.
    ``save_after``: also save a checkpoint after that step into ``out_dir`` (default
    ``$MESHFLOW_TEST_EXPERTS_OUT``), in its folder ``save_under``;
    ``resume``: start from that checkpoint (the steps after its own)."""
    pm = build_parallel_model(cfg, torch.device("cpu"))
    decoder = decoder_config(cfg.model)  # a Hugging Face MoE's: its config.json
    loss_fn = with_aux_loss(loss_fn_for(decoder), pm.model_parts, decoder, pipelined=pm.pipelined)
    optimizer = make_optimizer(pm.parameters())
    first = 0
    if resume is not None:
        first = int(load_checkpoint(resume, model=merged_module(pm.model_parts), optimizer=optimizer,
                                    tied=pm.tied_names)["step"])
    losses, aux, norms = [], [], []
    for step, (inputs, targets) in enumerate(batches(decoder)[first:], start=first + 1):
        per = inputs.shape[0] // pm.dp_size
        share = slice(pm.dp_rank * per, (pm.dp_rank + 1) * per)
        inputs, targets = inputs[share], targets[share]
        if pm.cp_size > 1:  # each cp rank its head and tail chunks of the same rows, as the data loader cuts them
            inputs, targets = (shard_sequence(x, dim=1, cp_rank=pm.cp_rank, cp_size=pm.cp_size) for x in (inputs, targets))
        loss = pm.forward_backward(inputs, targets, loss_fn)
        norms.append(pm.clip_grad_norm_(GRAD_CLIP))
        optimizer.step()
        optimizer.zero_grad()
        losses.append(pm.reduce_loss(loss))
        aux.append(pm.reduce_loss(loss_fn.take()[0]))
        if step == save_after:
            save_checkpoint(os.path.join(out_dir or os.environ[OUT_ENV], save_under), step,
                            model=merged_module(pm.model_parts), optimizer=optimizer,
                            extra={"step": step, "model_config": cfg.model.model_dump(mode="json")}, keep=1,
                            tied=pm.tied_names)
    named = {name.removeprefix("model."): p for name, p in pm.named_parameters()}  # a Hugging Face model's too
    return {"losses": losses, "aux": aux, "grad_norms": norms, "dp_size": pm.dp_size,
            "w1": _where(named.get("layers.0.mlp.experts.w1")),  # None on a stage without block 0
            "wq": _where(named.get("layers.0.attn.wq.weight", named.get("layers.0.self_attn.q_proj.weight")))}


def _where(param: torch.Tensor | None) -> dict:
    """A DTensor parameter's placements, mesh axes, local shape and the rows of the whole tensor its local
    shard is (found by value: every rank gathers the whole; {} for a plain tensor, or one another
    pipeline stage holds)."""
    if not isinstance(param, DTensor):
        return {}
    full, local = param.full_tensor(), param.to_local()
    n = local.shape[0]
    start = next((s for s in range(full.shape[0] - n + 1) if torch.equal(full[s:s + n], local)), None) if n else 0
    return {"placements": [repr(p) for p in param.placements], "mesh_dims": list(param.device_mesh.mesh_dim_names),
            "local_shape": list(local.shape), "rows": None if start is None else [start, start + n]}


def memory_check(overrides: list[str]):
    """The trainer's loop (:func:`trainer.run.loop.train`) on ``MEMORY``'s wide experts under ``overrides``:
    the peak memory it measured (the largest rank's, after the last step), which the parent holds against
    the plan's prediction."""
    def check(*, rank: int, world_size: int) -> dict:
        cfg = validate_config(compose_dict([*MEMORY, *overrides]), check_model=False)
        code_pages = []  # the shared libraries' code pages resident when the loop's meter reads the floor
        made = MemoryMeter.__init__

        def meter_made(meter, device):
            made(meter, device)
            code_pages.append(_proc_status_kib("RssFile") or 0.0)

        MemoryMeter.__init__ = meter_made  # type: ignore[method-assign]
        try:
            result = train(cfg, tracker=NullTracker(), progress=NullProgress(), rank=rank, predicted_peak_mib=0.0)
        finally:
            MemoryMeter.__init__ = made  # type: ignore[method-assign]
        # The code pages first run since: resident, so in the peak, but shared by a host's workers, and how many
        # a first run maps is the kernel's (see the test). This rank's peak without them:
        code_pages_mb = ((_proc_status_kib("RssFile") or 0.0) - code_pages[0]) / 1024
        own_mb = ((_proc_status_kib("VmHWM") or 0.0) - (metrics._PROCESS_FLOOR_KIB or 0.0)) / 1024 - code_pages_mb
        return {"peak_memory_mb": result.peak_memory_mb, "own_peak_mb": own_mb, "code_pages_mb": code_pages_mb,
                "losses": result.losses}

    return check


def expert_check(overrides: list[str], *, out_dir: str | None = None, resume: str | None = None, **options):
    """A check: :func:`train_moe` under ``overrides``; ``out_dir``: save into that folder of
    ``$MESHFLOW_TEST_EXPERTS_OUT``, ``resume``: a checkpoint's path relative to it."""
    def check(*, rank: int, world_size: int) -> dict:
        root = os.environ.get(OUT_ENV, "")
        return train_moe(run_config(overrides), out_dir=os.path.join(root, out_dir or ""),
                         resume=os.path.join(root, resume) if resume else None, **options)

    return check


_PP_EP = ["+parallel=pp", "mesh=[2,2]", "parallel.dims=[pp,ep]", "+parallel.expert_parallel={dim: ep}"]

_HSDP_EP = ["+parallel=hsdp", "parallel.dims=[dp_replicate,dp_shard,ep]", "+parallel.expert_parallel={dim: ep}"]

SUITES = {
    "two_rank": [
        ("ep", expert_check(["+parallel=ep", "mesh=[2]"], save_after=2)),  # and a checkpoint one device resumes
        ("fsdp", expert_check(["+parallel=fsdp", "mesh=[2]"])),  # experts sharded by FSDP, no ep axis
        ("tp", expert_check(["+parallel=tp", "mesh=[2]"])),  # attention split over tp, the MoE on every tp rank
        # A dp axis of one rank: torch 2.13's FSDP2 divides a one-rank reduce-scatter's gradients by the
        # divide factor twice under a forced sum (parallel.sharding.data_parallel does not force it there).
        ("fsdp_ep1", expert_check(["+parallel=fsdp_ep", "mesh=[1,2]"])),
    ],
    "four_rank": [
        ("fsdp_ep", expert_check(["+parallel=fsdp_ep", "mesh=[2,2]"])),
        ("ep4", expert_check(["+parallel=ep", "mesh=[4]"])),
        ("ep_tp", expert_check(["+parallel=ep", "mesh=[2,2]", "parallel.dims=[ep,tp]",
                                "parallel.tensor_parallel={dim: tp}"])),
        ("2d", expert_check(["+parallel=2d", "mesh=[2,2]"])),  # fsdp x tp, no ep axis
        ("zero2_ep", expert_check(["+parallel=fsdp_ep", "mesh=[2,2]", "parallel.data_parallel.mode=zero2"])),
        # hsdp: the experts HSDP over [dp_replicate, dp_shard] (its shard axis one rank here), the rest
        # replicated over dp_replicate and sharded over dp_shard x ep
        ("hsdp_ep", expert_check([*_HSDP_EP, "mesh=[2,1,2]"])),
    ],
    "eight_rank": [  # slow: 8 processes
        ("ep8_memory", memory_check(["+parallel=ep", "mesh=[8]"])),  # first: what the processes hold is its own
        ("3d_ep", expert_check(["+parallel=3d_ep"])),
        ("3d", expert_check(["+parallel=3d"])),  # fsdp x pp x tp, no ep: each stage's blocks add their balance loss
        ("pp_ep_tp", expert_check(["+parallel=pp", "mesh=[2,2,2]", "parallel.dims=[pp,ep,tp]",
                                   "+parallel.expert_parallel={dim: ep}", "+parallel.tensor_parallel={dim: tp}",
                                   "parallel.pipeline.microbatches=2"])),
    ],
    # Slow: a pipeline's stages each add their blocks' balance loss (pp x ep [2, 2], four schedules).
    "four_rank_slow": [
        ("hsdp_ep_sharded", expert_check([*_HSDP_EP, "mesh=[1,2,2]"])),  # hsdp's shard axis of two ranks
        ("pp_ep", expert_check([*_PP_EP, "parallel.pipeline.microbatches=2"])),
        ("pp_ep_gpipe", expert_check([*_PP_EP, "parallel.pipeline.schedule=GPipe"])),
        ("pp_ep_interleaved", expert_check([*_PP_EP, "parallel.pipeline.schedule=Interleaved1F1B",
                                            "parallel.pipeline.stages_per_rank=2"])),
        # Zero bubble: each backward split into an input and a weight pass, the carried term in the first.
        ("pp_ep_zbv", expert_check([*_PP_EP, "parallel.pipeline.schedule=ZBV", "parallel.pipeline.stages_per_rank=2"])),
    ],
    # Slow: an ep [2] checkpoint read back on fsdp [2] (and, by the parent, on one device).
    "two_rank_slow": [
        ("ep_saves", expert_check(["+parallel=ep", "mesh=[2]"], save_after=2, out_dir="ep_saves")),
        ("fsdp_resumes_ep", expert_check(["+parallel=fsdp", "mesh=[2]"], resume="ep_saves/step_00000002")),
    ],
}
