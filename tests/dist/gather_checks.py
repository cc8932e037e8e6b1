"""The final model's gather (:func:`parallel.sharding.gather.full_state_on_rank0`) on every kind of
layout, inside the worker processes of one 4-rank launch (``dist_harness``): each check builds the
default model on the trainer's road (meta, sharded, split, only local shards initialised from the
seed: one device's values) and gathers it to rank 0, which compares every tensor with the model
built whole on one device and loads it into the plain model the run's export writes from.
"""

from __future__ import annotations

import torch

from parallel.sharding.gather import full_state_on_rank0
from trainer.checkpoint.dcp import merged_module
from trainer.config.compose import compose_dict
from trainer.models import build_model
from trainer.run.build import build_parallel_model
from trainer.run.final_model import plain_model
from trainer.validate.checks import validate_config

SMALL = ["train.seq_len=32", "train.global_batch_size=8", "data=synthetic"]


def gather_check(overrides: list[str]):
    def check(*, rank: int, world_size: int) -> dict:
        cfg = validate_config(compose_dict([*SMALL, *overrides]))
        pm = build_parallel_model(cfg, torch.device("cpu"))
        state = full_state_on_rank0(merged_module(pm.model_parts))
        if rank != 0:
            return {"none_here": state is None}
        whole = build_model(cfg.model, seed=cfg.train.seed).state_dict()
        plain = plain_model(cfg, state).state_dict()  # what the export writes from
        return {"missing": sorted(whole.keys() - state.keys()), "unexpected": sorted(state.keys() - whole.keys()),
                "max_abs_diff": max(float((state[k] - whole[k]).abs().max()) for k in whole.keys() & state.keys()),
                "plain_equal": all(plain[k].equal(whole[k]) for k in whole),
                "parts": len(pm.model_parts), "tensors": len(state)}
    return check


SUITES = {
    "four_rank": [
        ("fsdp_tp", gather_check(["+parallel=2d", "mesh=[2,2]"])),
        ("pp_tp", gather_check(["+parallel=3d", "mesh=[1,2,2]"])),
        ("dp_pp_interleaved", gather_check(["+parallel=3d", "mesh=[2,2,1]", "parallel.pipeline.stages_per_rank=2",
                                            "parallel.pipeline.schedule=Interleaved1F1B",
                                            "parallel.pipeline.boundaries=auto"])),
        ("pp_stages", gather_check(["+parallel=pp_stages"])),
        ("hsdp", gather_check(["+parallel=hsdp", "mesh=[2,2]"])),
        ("fsdp_cp", gather_check(["+parallel=fsdp_cp", "mesh=[2,2]"])),
        ("fsdp_ep", gather_check(["model=gpt_moe", "+parallel=fsdp_ep", "mesh=[2,2]"])),
    ],
    "eight_rank": [  # a stage's own cp axis, and (gpt_moe) a stage's own ep axis, beside an fsdp x tp stage
        ("pp_stages_cp", gather_check(["+parallel=pp_stages_cp"])),
        ("pp_stages_ep", gather_check(["model=gpt_moe", "+parallel=pp_stages_ep"])),
    ],
}
