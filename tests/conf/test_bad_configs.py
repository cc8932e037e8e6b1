"""Every documented kind of bad config gives its message: the exact config path, a reason that
states the numbers involved, and a fix. Each case is composed from ``conf/`` with Hydra overrides
(as a user types them after ``python -m trainer``), and edited as a dict where Hydra's override
grammar cannot express it (placement globs contain ``*`` and ``[``).

Cases under ``crash/`` raised an exception other than ConfigError (or hung) before the fix; cases
under ``fixed/`` were silently accepted or got a misleading message. Most were found by
``test_fuzz.py``; they stay here so they cannot come back.

Run: ``python -m pytest tests/conf/test_bad_configs.py -q``
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import pytest

from parallel.errors import ConfigError, ConfigIssue
from tests.conftest import run_cli
from trainer.__main__ import FIRST_LINE
from trainer.config.compose import compose_dict
from trainer.validate.checks import validate_config

Edit = Callable[[dict[str, Any]], None]


@lru_cache(maxsize=None)
def _composed(overrides: tuple[str, ...]) -> dict[str, Any]:
    return compose_dict(list(overrides))


def compose(*overrides: str) -> dict[str, Any]:
    return copy.deepcopy(_composed(tuple(overrides)))


def put(*keys_and_value: Any) -> Edit:
    """An edit setting ``raw[k1][k2]...[kn] = value`` (creating dicts on the way)."""
    *keys, value = keys_and_value

    def edit(raw: dict[str, Any]) -> None:
        node = raw
        for key in keys[:-1]:
            node = node.setdefault(key, {})
        node[keys[-1]] = value

    return edit


def drop(*keys: str) -> Edit:
    def edit(raw: dict[str, Any]) -> None:
        node = raw
        for key in keys[:-1]:
            node = node[key]
        del node[keys[-1]]

    return edit


def both(*edits: Edit) -> Edit:
    def edit(raw: dict[str, Any]) -> None:
        for e in edits:
            e(raw)

    return edit


@dataclass(frozen=True)
class Bad:
    """A bad config and the issue it must produce: ``path`` exactly, phrases in reason and fix."""

    overrides: tuple[str, ...]
    path: str
    reason: tuple[str, ...]
    fix: tuple[str, ...] = ()
    edit: Edit | None = None


def bad(overrides: list[str], path: str, reason: list[str], fix: list[str] = (), edit: Edit | None = None) -> Bad:
    return Bad(tuple(overrides), path, tuple(reason), tuple(fix), edit)


WQKV, WO, W13, W2 = (
    "layers.*.attn.w[qkv].weight",
    "layers.*.attn.wo.weight",
    "layers.*.mlp.w[13].weight",
    "layers.*.mlp.w2.weight",
)


def placement_path(glob: str, axis: str | None = None) -> str:
    return f'parallel.placements["{glob}"]' + (f".{axis}" if axis else "")


CASES: dict[str, Bad] = {
    # ------------------------------------------------------------------------------- schema
    "schema/unknown-top-level-key": bad(
        ["+foo=1"], "foo", ["unknown key"], ["known keys here", "parallel", "train", "validate_only"]),
    "schema/unknown-nested-key": bad(
        ["+train.stepz=10"], "train.stepz", ["unknown key"], ["known keys here", "steps", "global_batch_size"]),
    "schema/typo-of-a-key": bad(  # typed without + as a user would: composed, then named with its likely key
        ["train.step=50"], "train.step", ["unknown key"], ["did you mean train.steps?"]),
    "schema/typo-in-a-preset-section": bad(
        ["+parallel=3d", "parallel.pipeline.microbatch=8"], "parallel.pipeline.microbatch", ["unknown key"],
        ["did you mean parallel.pipeline.microbatches?"]),
    "schema/unknown-key-in-pipeline": bad(
        ["+parallel=3d", "+parallel.pipeline.microbatch=8"], "parallel.pipeline.microbatch", ["unknown key"],
        ["known keys here", "microbatches", "stages_per_rank"]),
    "schema/unknown-key-in-model-union": bad(
        ["+model.hidden=3"], "model.hidden", ["unknown key"], ["known keys here", "n_heads", "ffn_hidden_dim"]),
    "schema/unknown-key-in-layout": bad(
        ["+parallel=tp_sp"], 'parallel.layouts["layers.*.attn_norm"].inptu', ["unknown key"],
        ["known keys here", "input", "output"],
        edit=put("parallel", "layouts", "layers.*.attn_norm", "inptu", {"tp": "Shard(1)"})),
    "schema/wrong-type-int": bad(
        ["train.steps=abc"], "train.steps", ["valid integer", "'abc'"], ["expected type"]),
    "schema/wrong-type-list": bad(
        ["+parallel=dp", "parallel.dims=dp"], "parallel.dims", ["valid list", "'dp'"], ["expected type"]),
    "schema/out-of-range-int": bad(
        ["train.steps=0"], "train.steps", ["greater than or equal to 1", "got 0"], ["allowed range"]),
    "schema/out-of-range-float": bad(
        ["optim.lr=0"], "optim.lr", ["greater than 0", "got 0"], ["allowed range"]),
    "schema/bad-enum-schedule": bad(
        ["+parallel=3d", "parallel.pipeline.schedule=Foo"], "parallel.pipeline.schedule",
        ["'Foo'", "'GPipe'", "'1F1B'", "'ZBV'"], ["one of the listed values"]),
    "schema/bad-enum-dp-mode": bad(
        ["+parallel=fsdp", "parallel.data_parallel.mode=zero3"], "parallel.data_parallel.mode",
        ["'zero3'", "'ddp'", "'zero1'", "'fsdp'", "'zero2'", "'hsdp'"], ["one of the listed values"]),
    "schema/bad-placement-string": bad(
        ["+parallel=tp"], placement_path(WO, "tp"),
        ["'Shard(x)' is not a placement", "Shard(<tensor dim>)", "Replicate"],
        ["valid value"], edit=put("parallel", "placements", WO, "tp", "Shard(x)")),
    "schema/placement-not-a-string": bad(
        ["+parallel=tp"], placement_path(WO, "tp"), ["expected a placement string", "got 1"],
        edit=put("parallel", "placements", WO, "tp", 1)),
    "schema/unknown-model-arch": bad(
        ["model.arch=gpt"], "model.arch", ["unknown value 'gpt'", "'llama'", "'mlp'"], ["one of the listed values"]),
    "schema/model-arch-missing": bad(
        [], "model.arch", ["required key is missing"], ["model.arch", "model=gpt_debug"], edit=drop("model", "arch")),
    "schema/parallel-dims-missing": bad(
        ["+parallel=dp"], "parallel.dims", ["required key is missing"], ["add it"], edit=drop("parallel", "dims")),
    # --------------------------------------------------------------------------------- mesh
    "mesh/zero-size": bad(["+parallel=dp", "mesh=[0]"], "mesh[0]", ["must be >= 1", "got 0"], ["positive"]),
    "mesh/negative-size": bad(["+parallel=2d", "mesh=[2,-1]"], "mesh[1]", ["must be >= 1", "got -1"], ["positive"]),
    "mesh/empty": bad(["+parallel=dp", "mesh=[]"], "mesh", ["is empty"], ["one size per axis", "mesh=[2]", "null"]),
    "mesh/non-rectangular-ids": bad(
        ["+parallel=2d", "mesh=[[0,1],[2]]"], "mesh", ["rectangular", "mesh[1] has 1 entries, expected 2"],
        ["same length"]),
    "mesh/duplicate-ids": bad(
        ["+parallel=2d", "mesh=[[0,1],[1,2]]"], "mesh", ["[0, 1, 1, 2]", "not each of 0..3 exactly once"],
        ["every rank id from 0 to 3 once"]),
    "mesh/dims-count-mismatch": bad(
        ["+parallel=3d", "mesh=[2,2]"], "parallel.dims", ["names 3 axes", "['dp', 'pp', 'tp']", "mesh [2, 2] has 2"],
        ["one name per mesh axis"]),
    "mesh/duplicate-axis-name": bad(
        ["+parallel=2d", "parallel.dims=[dp,dp]"], "parallel.dims[1]", ["axis name 'dp' is used twice"],
        ["its own name"]),
    "mesh/axis-name-not-identifier": bad(
        ["+parallel=dp", "parallel.dims=[d-p]", "parallel.data_parallel.dim=d-p"], "parallel.dims[0]",
        ["'d-p' is not a valid axis name"], ["identifier"]),
    "mesh/mesh-without-parallel": bad(
        ["mesh=[2]"], "mesh", ["[2] has 2 devices", "no parallel section"], ["+parallel=fsdp"]),
    "mesh/parallel-without-mesh": bad(
        ["+parallel=dp", "mesh=null"], "mesh", ["parallel section needs a mesh"], ["mesh=[2]"]),
    "mesh/explicit-ids-on-several-hosts": bad(
        ["+parallel=2d", "mesh=[[0,1],[2,3]]", "launch.nnodes=2"], "mesh", ["explicit rank ids", "one host only"],
        ["mesh shape"]),
    # ------------------------------------------------------------------------ data parallel
    "dp/unknown-axis": bad(
        ["+parallel=dp", "parallel.data_parallel.dim=xp"], "parallel.data_parallel.dim",
        ["axis 'xp' is not in parallel.dims ['dp']"], ["use one of ['dp']"]),
    "dp/hsdp-with-one-axis": bad(
        ["+parallel=hsdp", "parallel.data_parallel.dim=dp_shard"], "parallel.data_parallel.dim",
        ["mode hsdp takes 2 axis name(s)", "['dp_shard']"], ["two axes", "[replicate_axis, shard_axis]"]),
    "dp/ddp-with-two-axes": bad(
        ["+parallel=hsdp", "parallel.data_parallel.mode=ddp"], "parallel.data_parallel.dim",
        ["mode ddp takes 1 axis name(s)", "['dp_replicate', 'dp_shard']"], ["one axis name", "hsdp"]),
    # ----------------------------------------------------------------------------- pipeline
    "pipeline/axis-is-dp-axis": bad(
        ["+parallel=3d", "parallel.pipeline.dim=dp"], "parallel.pipeline.dim",
        ["'dp' is already the data-parallel axis"], ["its own mesh axis"]),
    "pipeline/unknown-axis": bad(
        ["+parallel=3d", "parallel.pipeline.dim=pq"], "parallel.pipeline.dim",
        ["axis 'pq' is not in parallel.dims ['dp', 'pp', 'tp']"]),
    "pipeline/interleaved-one-stage-per-rank": bad(
        ["+parallel=3d", "parallel.pipeline.schedule=Interleaved1F1B"], "parallel.pipeline.stages_per_rank",
        ["Interleaved1F1B", "needs >= 2, got 1"], ["stages_per_rank=2"]),
    "pipeline/zbv-three-stages-per-rank": bad(
        ["+parallel=3d", "parallel.pipeline.schedule=ZBV", "parallel.pipeline.stages_per_rank=3"],
        "parallel.pipeline.stages_per_rank", ["ZBV", "exactly 2", "got 3"], ["stages_per_rank=2"]),
    "pipeline/gpipe-two-stages-per-rank": bad(
        ["+parallel=pp", "parallel.pipeline.schedule=GPipe", "parallel.pipeline.stages_per_rank=2"],
        "parallel.pipeline.stages_per_rank", ["GPipe runs one stage per rank, got 2"], ["stages_per_rank=1"]),
    "pipeline/1f1b-fewer-microbatches-than-stages": bad(
        ["+parallel=pp", "mesh=[4]", "parallel.pipeline.microbatches=2"], "parallel.pipeline.microbatches",
        ["1F1B", "2 < pp size 4"], ["microbatches=4 or more"]),
    "pipeline/interleaved-microbatches-not-multiple": bad(
        ["+parallel=pp", "parallel.pipeline.schedule=Interleaved1F1B", "parallel.pipeline.stages_per_rank=2",
         "parallel.pipeline.microbatches=3", "train.global_batch_size=12"], "parallel.pipeline.microbatches",
        ["divisible by the pp size 2, got 3"], ["multiple of 2"]),
    "pipeline/boundary-missing-module": bad(
        ["+parallel=3d", "parallel.pipeline.boundaries=[layers.9]"], "parallel.pipeline.boundaries[0]",
        ["'layers.9' is not a top-level module"], ["layers.1", "layers.3", "norm"]),
    "pipeline/boundaries-out-of-order": bad(
        ["+parallel=3d", "mesh=[1,4,2]", "parallel.pipeline.boundaries=[layers.2,layers.1,layers.3]"],
        "parallel.pipeline.boundaries", ["['layers.2', 'layers.1', 'layers.3'] are not in forward order"],
        ["in the order the model runs them"]),
    "pipeline/boundaries-wrong-count": bad(
        ["+parallel=3d", "parallel.pipeline.boundaries=[layers.1,layers.2]"], "parallel.pipeline.boundaries",
        ["2 boundaries make 3 stages", "pp size 2 x stages_per_rank 1 needs 2"], ["give 1 boundary,", "auto"]),
    "pipeline/first-module-as-boundary": bad(
        ["+parallel=3d", "parallel.pipeline.boundaries=[tok_embeddings]"], "parallel.pipeline.boundaries[0]",
        ["'tok_embeddings' is the first module", "stage 0"], ["later stage"]),
    "pipeline/auto-too-many-stages": bad(
        ["+parallel=pp", "mesh=[8]", "parallel.pipeline.microbatches=8"], "parallel.pipeline.boundaries",
        ["auto needs 8 stages", "only 7 pieces", "tok_embeddings, layers.0"], ["smaller pp size", "deeper model"]),
    "pipeline/auto-too-many-interleaved-stages": bad(
        ["+parallel=pp", "mesh=[4]", "parallel.pipeline.schedule=Interleaved1F1B",
         "parallel.pipeline.stages_per_rank=2"],
        "parallel.pipeline.boundaries", ["auto needs 8 stages", "only 7 pieces"]),
    # --------------------------------------------------------------------------- placements
    "placements/glob-matches-nothing": bad(
        ["+parallel=tp"], placement_path("layers.*.attn.wz.weight"), ["matches no parameter"],
        ["fix the glob", "tok_embeddings.weight"], edit=put("parallel", "placements", "layers.*.attn.wz.weight",
                                                            {"tp": "Shard(0)"})),
    "placements/unknown-axis": bad(
        ["+parallel=tp"], placement_path(WO, "tq"), ["axis 'tq' is not in parallel.dims ['tp']"], ["use one of ['tp']"],
        edit=put("parallel", "placements", WO, {"tq": "Shard(1)"})),
    "placements/partial-on-parameter": bad(
        ["+parallel=tp"], placement_path(WO, "tp"), ["Partial() on a parameter", "must be whole"],
        ["Shard(d) or Replicate", "layouts"], edit=put("parallel", "placements", WO, "tp", "Partial")),
    "placements/on-dp-axis": bad(
        ["+parallel=2d"], placement_path("tok_embeddings.weight", "dp"), ["axis 'dp' is the data_parallel axis"],
        ["only on tensor-parallel axes"], edit=put("parallel", "placements", "tok_embeddings.weight",
                                                   {"dp": "Shard(0)"})),
    "placements/on-pp-axis": bad(
        ["+parallel=3d"], placement_path("tok_embeddings.weight", "pp"), ["axis 'pp' is the pipeline axis"],
        edit=put("parallel", "placements", "tok_embeddings.weight", {"pp": "Shard(0)"})),
    "placements/shard-dim-past-2d-weight": bad(
        ["+parallel=tp"], placement_path(WO, "tp"), ["Shard(2)", "layers.0.attn.wo.weight has 2 dims", "[64, 64]"],
        ["Shard(0) .. Shard(1)"], edit=put("parallel", "placements", WO, "tp", "Shard(2)")),
    "placements/uneven-shard-172-over-8": bad(  # the DESIGN's example, word for word
        ["+parallel=tp", "mesh=[8]"], placement_path(W13, "tp"),
        ["Shard(0) splits dim 0 of size 172 over 8 ranks; 172 is not divisible by 8"],
        ["use a tp size dividing 172, or Replicate"], edit=put("parallel", "placements", W13, {"tp": "Shard(0)"})),
    "placements/uneven-row-shard-172-over-8": bad(
        ["+parallel=tp", "mesh=[8]"], placement_path(W2, "tp"),
        ["Shard(1) splits dim 1 of size 172 over 8 ranks; 172 is not divisible by 8"],
        edit=put("parallel", "placements", W2, {"tp": "Shard(1)"})),
    "placements/named-plan-uneven-over-8": bad(  # the same through the model's megatron plan
        ["+parallel=tp", "mesh=[8]"], f'parallel.tensor_parallel.plan[megatron]["{W13}"].tp',
        ["Shard(0) splits dim 0 of size 172 over 8 ranks; 172 is not divisible by 8"],
        ["use a tp size dividing 172, or Replicate: 'parallel.placements={\"layers.*.mlp.w[13].weight\": {tp: "
         "Replicate}}'"]),
    "placements/uneven-2d-tensor-parallel": bad(
        ["+parallel=tp", "mesh=[2,4]", "parallel.dims=[tp,tp2]"], placement_path(W13, "tp2"),
        ["Shard(0) splits dim 0 of size 172 over 8 ranks (tp x tp2); 172 is not divisible by 8"],
        ["tp x tp2 size dividing 172"], edit=put("parallel", "placements", W13, {"tp": "Shard(0)", "tp2": "Shard(0)"})),
    "placements/heads-not-divisible-by-tp": bad(
        ["+parallel=tp", "mesh=[4]"], placement_path(WQKV, "tp"),
        ["split by heads", "model.n_kv_heads=2 over tp size 4"], ["tp size dividing 2", "Replicate"],
        edit=put("parallel", "placements", WQKV, {"tp": "Shard(0)"})),
    "placements/named-plan-heads-not-divisible-by-tp": bad(
        ["+parallel=tp", "mesh=[4]"], f'parallel.tensor_parallel.plan[megatron]["{WQKV}"].tp',
        ["split by heads", "model.n_kv_heads=2 over tp size 4"], ["tp size dividing 2", "or Replicate: "
                                                                                        "'parallel.placements={"]),
    "placements/overlapping-globs": bad(
        ["+parallel=tp"], placement_path("layers.0.attn.wq.weight"),
        ["parameter layers.0.attn.wq.weight is also matched by 'layers.*.attn.w[qkv].weight'"], ["disjoint"],
        edit=lambda raw: [put("parallel", "placements", glob, {"tp": "Shard(0)"})(raw)
                          for glob in (WQKV, "layers.0.attn.wq.weight")]),
    # ------------------------------------------------------------------------------ layouts
    "layouts/glob-matches-nothing": bad(
        ["+parallel=tp_sp"], 'parallel.layouts["layers.*.attn_nrom"]', ["matches no module"],
        ["fix the glob", "tok_embeddings"], edit=put("parallel", "layouts", "layers.*.attn_nrom",
                                                    {"input": {"tp": "Shard(1)"}})),
    "layouts/unknown-axis": bad(
        ["+parallel=tp_sp"], 'parallel.layouts["layers.*.attn_norm"].input.sq',
        ["axis 'sq' is not in parallel.dims ['tp']"], ["use one of ['tp']"],
        edit=put("parallel", "layouts", "layers.*.attn_norm", {"input": {"sq": "Shard(1)"}})),
    "layouts/sequence-does-not-split-over-sp-axis": bad(
        ["+parallel=tp_sp", "mesh=[2]", "train.seq_len=31"], "train.seq_len",
        ["31 tokens do not split evenly over the sequence-parallel axis 'tp' of size 2"],
        ["use a multiple of 2, e.g. train.seq_len=32"]),
    "data/text-root-does-not-exist": bad(
        ["data.root=/nonexistent/meshflow-texts"], "data.root", ["'/nonexistent/meshflow-texts' does not exist"],
        ["data.root=stdlib"]),
    # -------------------------------------------------------------------- batch, model, misc
    "batch/not-divisible-by-dp-x-microbatches": bad(
        ["+parallel=3d", "train.global_batch_size=12"], "train.global_batch_size",
        ["12 sequences", "dp size 2 x microbatches 4 x grad_accum 1 = 8"],
        ["multiple of 8", "e.g. train.global_batch_size=16"]),
    "batch/not-divisible-with-grad-accum": bad(
        ["+parallel=fsdp", "train.global_batch_size=16", "train.grad_accum=3"], "train.global_batch_size",
        ["16 sequences", "dp size 2 x microbatches 1 x grad_accum 3 = 6"],
        ["multiple of 6", "e.g. train.global_batch_size=18"]),
    "model/seq-len-over-max": bad(
        ["train.seq_len=1000"], "train.seq_len", ["1000 is longer than model.max_seq_len 256"], ["seq_len <= 256"]),
    "model/mlp-with-text-data": bad(
        ["model=mlp"], "data.kind", ["model mlp cannot train on text data"], ["data=regression"]),
    "model/llama-with-regression-data": bad(
        ["data=regression"], "data.kind", ["model llama cannot train on regression data"],
        ["data=text", "data=synthetic"]),
    "model/heads-do-not-divide-dim": bad(
        ["model.n_heads=5", "model.n_kv_heads=null"], "model.n_heads", ["dim 64 does not split into 5 heads"]),
    "model/kv-heads-do-not-group": bad(
        ["model.n_kv_heads=3"], "model.n_kv_heads", ["4 query heads do not group over 3 kv heads"]),
    "model/vocab-too-small-for-bytes": bad(
        ["model.vocab_size=128"], "model.vocab_size", ["256 token ids", "got 128"], ["model.vocab_size=256"]),
    "model/synthetic-symbols-exceed-vocab": bad(
        ["data=synthetic", "model.vocab_size=8"], "data.num_symbols", ["16 symbols exceed model.vocab_size 8"]),
    "model/activation-checkpointing-on-mlp": bad(
        ["model=mlp", "data=regression", "+parallel=fsdp", "+parallel.activation_checkpointing=full"],
        "parallel.activation_checkpointing", ["model mlp has no transformer blocks"], ["none"]),
    "parallel/axis-used-by-nothing": bad(
        ["+parallel=2d"], "parallel.dims[1]", ["axis 'tp' of size 2 is used by nothing"],
        ["data_parallel, pipeline, context_parallel, tensor_parallel, expert_parallel or placements", "mesh size to 1"],
        edit=put("parallel", "tensor_parallel", None)),
    "train/checkpoint-every-past-steps": bad(
        ["train.steps=200", "train.checkpoint.every=500"], "train.checkpoint.every",
        ["500 is more than train.steps 200"], ["every <= steps"]),
    "train/compile-with-zero-bubble-schedule": bad(
        ["+parallel=pp", "parallel.pipeline.schedule=ZBV", "parallel.pipeline.stages_per_rank=2", "train.compile=true"],
        "train.compile", ["parallel.pipeline.schedule ZBV", "re-runs its whole backward"],
        ["parallel.pipeline.schedule=Interleaved1F1B", "parallel.pipeline.schedule=1F1B "
                                                       "parallel.pipeline.stages_per_rank=1",
         "train.compile=false"]),
    "launch/node-rank-not-below-nnodes": bad(
        ["launch.node_rank=1"], "launch.node_rank", ["1 is not below launch.nnodes 1"], ["from 0 to 0"]),
    "launch/nnodes-does-not-divide-world": bad(
        ["+parallel=3d", "launch.nnodes=3"], "launch.nnodes", ["world size 8 does not split over 3 hosts"]),
    # ------------------ crashes, and configs silently accepted or misreported, found and fixed
    "crash/hsdp-dims-longer-than-mesh": bad(  # was IndexError in config.axis_size via _check_batch
        ["+parallel=hsdp", "mesh=[4]"], "parallel.dims", ["names 2 axes", "mesh [4] has 1"]),
    "crash/hsdp-without-mesh": bad(  # was IndexError in config.axis_size via _check_batch
        ["+parallel=hsdp", "mesh=null"], "mesh", ["parallel section needs a mesh"], ["mesh=[2,2]"]),
    "crash/explicit-ids-with-no-ranks": bad(  # was ZeroDivisionError in _check_batch (dp size 0)
        ["+parallel=dp", "mesh=[[]]"], "mesh", ["hold no rank id", "0 devices"]),
    "fixed/explicit-ids-with-no-ranks-no-parallel": bad(  # was accepted: a mesh of 0 devices
        ["mesh=[[],[]]"], "mesh", ["hold no rank id", "0 devices"]),
    "fixed/mesh-size-bool": bad(  # was accepted: True counted as an axis of size 1
        ["+parallel=2d"], "mesh[0]", ["must be an int, got True"], edit=put("mesh", [True, 2])),
    "fixed/mesh-size-float": bad(  # was reported as a malformed explicit-rank-id list
        ["+parallel=dp", "mesh=[2.0]"], "mesh[0]", ["must be an int, got 2.0"], ["mesh=[2]"]),
    "fixed/hsdp-same-axis-twice": bad(  # was accepted, with dp size 4 on a mesh of 2
        ["+parallel=dp", "parallel.data_parallel.mode=hsdp", "parallel.data_parallel.dim=[dp,dp]"],
        "parallel.data_parallel.dim", ["names axis 'dp' twice"], ["two different axes"]),
    "crash/model-dim-overflows-int64-storage": bad(  # was RuntimeError from build_model on meta
        ["model.dim=2147483648", "model.n_heads=2", "model.n_kv_heads=null"], "model", ["too large to build"],
        ["fit in memory"]),
    "crash/vocab-size-past-int64": bad(  # was TypeError from torch.empty on meta
        [], "model", ["too large to build"], edit=put("model", "vocab_size", 2**70)),
    "crash/n-layers-huge": bad(  # was a hang: a million blocks built on the meta device
        ["model.n_layers=1000000"], "model.n_layers", ["1000000 blocks", "1024"], ["n_layers <= 1024"]),
    "fixed/seed-past-64-bits": bad(  # was accepted, then torch.manual_seed raised in every worker
        [], "train.seed", ["does not fit in 64 bits"], edit=put("train", "seed", 2**80)),
    "fixed/shard-on-1d-parameter-behind-star-glob": bad(  # was accepted: only the first match's shape was checked
        ["+parallel=tp"], placement_path("*", "tp"), ["Shard(1)", "layers.0.attn_norm.weight has 1 dims", "[64]"],
        ["use Shard(0),"], edit=put("parallel", "placements", {"*": {"tp": "Shard(1)"}})),
    "fixed/placement-key-not-a-string": bad(  # numbers are read as strings (Hydra gives `5` as an int)
        ["+parallel=tp"], 'parallel.placements["5"]', ["matches no parameter"],
        edit=put("parallel", "placements", {5: {"tp": "Shard(0)"}})),
    **{f"crash/nul-byte-in-{'-'.join(keys)}": bad(  # was ValueError: embedded null byte, from open() or mkdir
        overrides, ".".join(keys), ["NUL byte"], ["remove the NUL byte"], edit=put(*keys, "a\x00b"))
       for overrides, keys in [([], ("train", "checkpoint", "dir")), ([], ("train", "init_from")),
                               ([], ("data", "root")), ([], ("launch", "log_dir")),
                               (["data=chat"], ("data", "template")), (["data=files"], ("data", "tokenizer")),
                               (["model=hf"], ("model", "path"))]},
}


def _describe(issues: list[ConfigIssue]) -> str:
    return "\n".join(f"  {i.path!r}: {i.reason!r} / fix {i.fix!r}" for i in issues)


@pytest.mark.parametrize("case", list(CASES.values()), ids=list(CASES))
def test_bad_config_names_path_reason_and_fix(case: Bad):
    assert_bad(case)


def assert_bad(case: Bad) -> None:
    """The case's config is refused with an issue at its path whose reason and fix hold its phrases."""
    raw = compose(*case.overrides)
    if case.edit is not None:
        case.edit(raw)
    with pytest.raises(ConfigError) as excinfo:
        validate_config(raw)
    issues = excinfo.value.issues
    at_path = [i for i in issues if i.path == case.path]
    assert at_path, f"no issue at {case.path!r}; got:\n{_describe(issues)}"
    matching = [i for i in at_path
                if all(p in i.reason for p in case.reason) and all(p in i.fix for p in case.fix)]
    assert matching, f"issue at {case.path!r} lacks {case.reason} / {case.fix}; got:\n{_describe(at_path)}"
    for issue in issues:  # every issue, not only the expected one, is a complete sentence for the user
        assert issue.path and issue.reason and issue.fix, issue
    assert f"{case.path}: " in str(excinfo.value)  # the rendered error shows the path to the user


def test_enough_distinct_cases():
    assert len(CASES) >= 30
    assert len({(c.overrides, c.path, c.reason) for c in CASES.values()}) == len(CASES)


MEGATRON_GLOBS = {  # what the tp preset wrote before it named the model's plan; the DESIGN's example uses them
    "layers.*.attn.w[qkv].weight": {"tp": "Shard(0)"}, "layers.*.attn.wo.weight": {"tp": "Shard(1)"},
    "layers.*.mlp.w[13].weight": {"tp": "Shard(0)"}, "layers.*.mlp.w2.weight": {"tp": "Shard(1)"},
}


def test_design_example_renders_exactly():
    """DESIGN.md's example message, word for word, as the launcher prints it, with the override
    that replicates the glob spelt out after "or Replicate" (runnable as printed)."""
    raw = compose("+parallel=tp", "mesh=[8]")
    raw["parallel"] = {**raw["parallel"], "tensor_parallel": None, "placements": MEGATRON_GLOBS}
    with pytest.raises(ConfigError) as excinfo:
        validate_config(raw)
    expected = (
        'parallel.placements["layers.*.mlp.w[13].weight"].tp: Shard(0) splits dim 0 of size 172 over 8 ranks; '
        "172 is not divisible by 8 (use a tp size dividing 172, or Replicate: "
        "'parallel.placements={\"layers.*.mlp.w[13].weight\": {tp: Replicate}}')"
    )
    assert f"  - {expected}" in str(excinfo.value).splitlines()


def test_all_issues_reported_at_once():
    """Independent mistakes are reported together, so a user fixes them in one round."""
    raw = compose("+parallel=3d", "train.checkpoint.every=500", "launch.node_rank=1", "train.global_batch_size=12")
    with pytest.raises(ConfigError) as excinfo:
        validate_config(raw)
    paths = {i.path for i in excinfo.value.issues}
    assert {"train.checkpoint.every", "launch.node_rank", "train.global_batch_size"} <= paths
    assert str(excinfo.value).startswith(f"invalid config: {len(excinfo.value.issues)} problems")


def test_the_cli_names_a_typo_and_sets_keys_a_preset_does_not_state(tmp_path):
    """``train.step=50`` exits 2 with the key it resembles (not Hydra's struct error, exit 1); a key
    the preset leaves at its default is set without ``+``, as the validator's fixes print it."""
    typo = run_cli(["train.step=50"], cwd=tmp_path)
    assert typo.returncode == 2 and "train.step: unknown key (did you mean train.steps?" in typo.stderr, typo.stderr
    unstated = run_cli(["+parallel=fsdp", "parallel.activation_checkpointing=full", "validate_only=true"], cwd=tmp_path)
    assert unstated.returncode == 0 and unstated.stdout.startswith("config OK"), unstated.stderr


_PARALLEL_OPTIONS = ("options in trainer/conf/parallel: 2d, 3d, 3d_cp, 3d_ep, auto, cp, dp, ep, fsdp, "
                     "fsdp_cp, fsdp_ep, hsdp, hsdp_tp, pp, pp_stages, pp_stages_cp, pp_stages_ep, tp, tp2d, tp2d_dp, "
                     "tp2p5d, tp3d, tp3d_dp, tp_sp, zero1, zero2")


@pytest.mark.parametrize(("typed", "line"), [
    ("+parallel=fdsp", "parallel: unknown option 'fdsp' of config group parallel (did you mean fsdp? write "
                       "+parallel=fsdp; "
                       f"{_PARALLEL_OPTIONS})"),
    ("model=gpt_mo", "model: unknown option 'gpt_mo' of config group model (did you mean gpt_moe? write model=gpt_moe; "
                     "options in trainer/conf/model: custom, gpt_175b, gpt_debug, gpt_moe, gpt_small, hf, mlp)"),
    ("parallel=fsdp", "parallel: parallel=fsdp overrides a group the defaults list does not choose (append it with +: "
                      f"write +parallel=fsdp; {_PARALLEL_OPTIONS})"),
], ids=["appended-typo", "default-group-typo", "without-plus"])
def test_the_cli_names_a_config_groups_unknown_option(tmp_path, typed, line):
    """A config group's option Hydra cannot find (or a group written without the ``+`` it needs) exits 2
    with the group, the option it resembles and the override to type, as an unknown key does: not
    Hydra's search-path dump and exit 1."""
    proc = run_cli([typed, "validate_only=true"], cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.splitlines() == [FIRST_LINE, "invalid config: 1 problem", f"  - {line}"]
    assert proc.stdout == "" and list(tmp_path.iterdir()) == []
