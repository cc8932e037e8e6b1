"""Checks of per-stage layouts whose stage names a cp or an ep axis (``parallel.pipeline.stages[i].context_parallel``
/ ``expert_parallel``), run inside the worker processes of one launch per world size (``dist_harness``): the
trainer's own loop (:func:`trainer.run.loop.train`) on each layout; the parent compares its losses, and for the
mixture of experts its balance losses and gradient norms, with one device's (``test_stage_axes.py``).
"""

from __future__ import annotations

import os
from collections.abc import Callable

from trainer.config.compose import compose_dict
from trainer.run.metrics import NullProgress
from trainer.tracking.tracker import NullTracker
from trainer.validate.checks import validate_config

STEPS = 5
# 8 rows of 96 tokens (2 x cp chunks for cp 2, 3 and 4): 4 or 2 lanes x 2 micro-batches (llama9's 3 lanes: 6 rows).
BASE = ["train.seq_len=96", "train.global_batch_size=8", f"train.steps={STEPS}", "tracking=none",
        "train.checkpoint.save_final=false", "tracking.pictures=false", "train.eval_at_start=false", "optim.lr=1e-3",
        "optim.warmup_steps=0", "data=synthetic", "data.num_tokens=65536"]
# gpt_moe's balance loss weighted 1 (not 0.01), so that a wrong scale of its gradient shows in the gradient norms.
MODELS = {"dense": ["model=gpt_debug"], "moe": ["model=gpt_moe", "model.moe.aux_loss_weight=1.0"]}
DATA_ENV = "MESHFLOW_TEST_STAGE_AXES_DIR"  # set by the parent test: llama9/, a tiny Hugging Face Llama


def model_overrides(model: str) -> list[str]:
    """``dense`` gpt_debug, ``moe`` gpt_moe, ``llama9``: a Hugging Face Llama of 9 query heads over 3 kv heads
    (width 8) with tied embeddings."""
    if model == "llama9":
        return ["model=hf", f"model.path={os.environ.get(DATA_ENV, '')}/llama9"]
    return MODELS[model]


def stage(ranks: list, dims: list[str], **roles: dict) -> dict:
    """One ``parallel.pipeline.stages`` entry: ``roles`` by short name (dp: fsdp over the axis, tp: the Megatron
    plan, cp, ep)."""
    sections = {"dp": lambda axis: {"data_parallel": {"dim": axis, "mode": "fsdp"}},
                "tp": lambda axis: {"tensor_parallel": {"dim": axis, "plan": "megatron"}},
                "cp": lambda axis: {"context_parallel": {"dim": axis}},
                "ep": lambda axis: {"expert_parallel": {"dim": axis}}}
    entry: dict = {"ranks": ranks, "dims": dims}
    for role, axis in roles.items():
        entry.update(sections[role](axis))
    return entry


def run_config(model: str, stages: list[dict] | None, extra: list[str] = ()) -> dict:
    """The composed config of ``model`` on ``stages`` (None: one device), as the trainer validates it."""
    # llama9's 3 lanes x 2 micro-batches: 6 rows.
    overrides = [*model_overrides(model), *BASE, *(["train.global_batch_size=6"] if model == "llama9" else []), *extra]
    if stages is None:
        return compose_dict(overrides)
    world = sum(len(s["ranks"]) if not isinstance(s["ranks"][0], list) else len(s["ranks"]) * len(s["ranks"][0])
                for s in stages)
    raw = compose_dict(["+parallel=pp_stages", f"mesh=[{world}]", "parallel.pipeline.microbatches=2", *overrides])
    raw["parallel"]["pipeline"]["stages"] = stages
    return raw


def trained(model: str, stages: list[dict]):
    """A check: the trainer's loop on ``stages``; its figures, as every rank reports them."""

    def check(*, rank: int, world_size: int) -> dict:
        from trainer.run.loop import train

        cfg = validate_config(run_config(model, stages), check_model=False)
        result = train(cfg, tracker=NullTracker(), progress=NullProgress(), rank=rank, predicted_peak_mib=0.0)
        return {"losses": result.losses, "aux_losses": result.aux_losses, "grad_norms": result.grad_norms}

    return check


# The layouts, by name: [stages], the model they train.
LAYOUTS = {
    # four ranks: a tensor-parallel stage next to a context-parallel one, both ways round (the first stage's
    # input is token ids, the last's output the logits), and a mixture of experts' expert stage.
    "tp_then_cp": ("dense", [stage([0, 1], ["tp"], tp="tp"), stage([2, 3], ["cp"], cp="cp")]),
    "cp_then_tp": ("dense", [stage([0, 1], ["cp"], cp="cp"), stage([2, 3], ["tp"], tp="tp")]),
    "moe_tp_then_ep": ("moe", [stage([0, 1], ["tp"], tp="tp"), stage([2, 3], ["ep"], ep="ep")]),
    "moe_cp_then_dp": ("moe", [stage([0, 1], ["cp"], cp="cp"), stage([2, 3], ["dp"], dp="dp")]),
    # six ranks: the Hugging Face Llama of 9 heads, its attention split over tp 3, then cp 3; tied embeddings
    # on different stages.
    "llama9_tp_then_cp": ("llama9", [stage([0, 1, 2], ["tp"], tp="tp"), stage([3, 4, 5], ["cp"], cp="cp")]),
    # eight ranks: the presets, fsdp x tp then cp (a dense model and a mixture of experts), fsdp x tp then ep.
    "fsdp_tp_then_cp": ("dense", [stage([[0, 1], [2, 3]], ["dp", "tp"], dp="dp", tp="tp"),
                                  stage([4, 5, 6, 7], ["cp"], cp="cp")]),
    "moe_fsdp_tp_then_ep": ("moe", [stage([[0, 1], [2, 3]], ["dp", "tp"], dp="dp", tp="tp"),
                                    stage([4, 5, 6, 7], ["ep"], ep="ep")]),
    "moe_fsdp_tp_then_dp_x_cp": ("moe", [stage([[0, 1], [2, 3]], ["dp", "tp"], dp="dp", tp="tp"),
                                         stage([[4, 5], [6, 7]], ["dp", "cp"], dp="dp", cp="cp")]),
}

# A pp_stages_ep checkpoint (the preset: gpt_moe on fsdp x tp then ep) saved after step 2 of 5, resumed for steps 3 to 5
# on its own layout and on fsdp x ep [2, 4] (the parent resumes it on one device too), in the launch that saved it.
SAVED_AFTER = 2
PP_STAGES_EP = ["+parallel=pp_stages_ep"]
RESUMES = {"pp_stages_ep_resumes": PP_STAGES_EP,
           "fsdp_ep_resumes_pp_stages_ep": ["+parallel=fsdp_ep", "mesh=[2,4]"]}


def checkpoint_dir() -> str:
    """Where the pp_stages_ep run saves: ``$MESHFLOW_TEST_STAGE_AXES_DIR/pp_stages_ep``."""
    return os.path.join(os.environ.get(DATA_ENV, ""), "pp_stages_ep")


def preset_config(parallel: list[str], *extra: str) -> dict:
    """gpt_moe (balance loss weight 1) on a preset, or on one device with ``parallel=[]``."""
    return compose_dict([*MODELS["moe"], *BASE, *parallel, *extra])


def resume_config(parallel: list[str]) -> dict:
    """The rest of the run (steps 3 to 5) from the pp_stages_ep checkpoint, on ``parallel``'s layout."""
    return preset_config(parallel, f"train.checkpoint.resume={checkpoint_dir()}/step_{SAVED_AFTER:08d}",
                         f"train.checkpoint.dir={checkpoint_dir()}-resumed")


def save_config() -> dict:
    """The pp_stages_ep run of ``STEPS`` steps, a checkpoint saved every 2: the run it resumes is the same run (its
    learning-rate schedule spans the same steps), not one of 2 steps."""
    return preset_config(PP_STAGES_EP, f"train.checkpoint.every={SAVED_AFTER}", f"train.checkpoint.dir={checkpoint_dir()}")


def preset_trained(config: Callable[[], dict]):
    """A check: the trainer's loop on the composed config ``config()`` (composed in the worker, which reads the
    parent's environment); its figures, as every rank reports them."""

    def check(*, rank: int, world_size: int) -> dict:
        from trainer.run.loop import train

        cfg = validate_config(config(), check_model=False)
        result = train(cfg, tracker=NullTracker(), progress=NullProgress(), rank=rank, predicted_peak_mib=0.0)
        return {"losses": result.losses, "aux_losses": result.aux_losses, "grad_norms": result.grad_norms,
                "first_step": result.first_step, "last_checkpoint": result.last_checkpoint}

    return check


SUITES = {
    "four_rank": [(name, trained(*LAYOUTS[name])) for name in ("tp_then_cp", "cp_then_tp", "moe_tp_then_ep",
                                                                "moe_cp_then_dp")],
    "six_rank": [(name, trained(*LAYOUTS[name])) for name in ("llama9_tp_then_cp",)],
    "eight_rank": [(name, trained(*LAYOUTS[name])) for name in ("fsdp_tp_then_cp", "moe_fsdp_tp_then_ep",
                                                                 "moe_fsdp_tp_then_dp_x_cp")],
    "eight_rank_resume": [
        ("pp_stages_ep_saves", preset_trained(save_config)),
        *((name, preset_trained(lambda parallel=parallel: resume_config(parallel))) for name, parallel in RESUMES.items()),
    ],
}
