"""Property tests of the validator: whatever a user (or a REST client) sends, it either returns a
RunConfig or raises ConfigError whose every issue names a path, a reason and a fix. Any other
exception is a crash of the validator and fails the test.

(a) random JSON-like values at real paths of valid composed configs, and random extra keys;
(b) coherent dp/pp/tp layouts built from plausible pieces, then broken in a few plausible ways,
    so most examples get past the schema into the structure and model-aware checks.

Run: ``python -m pytest tests/conf/test_fuzz.py -q``
"""

from __future__ import annotations

import copy
import math
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from parallel.errors import ConfigError
from trainer.config.compose import compose_dict
from trainer.config.schema import RunConfig
from trainer.validate.checks import validate_config

FUZZ = settings(
    max_examples=150,
    deadline=None,
    derandomize=True,  # the same examples on every run: CI stays stable
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

# Valid composed configs the mutations start from: together they hold every section,
# including parallel.pipeline, parallel.placements, parallel.layouts and nested hsdp axes.
BASES: dict[str, dict[str, Any]] = {
    "default": compose_dict([]),
    "3d": compose_dict(["+parallel=3d"]),
    "hsdp": compose_dict(["+parallel=hsdp"]),
    "tp_sp": compose_dict(["+parallel=tp_sp"]),
    "pp": compose_dict(["+parallel=pp", "data=synthetic"]),
    "mlp_fsdp": compose_dict(["model=mlp", "data=regression", "+parallel=fsdp"]),
    "explicit_ids": compose_dict(["+parallel=2d", "mesh=[[0,2],[1,3]]", "model=gpt_small"]),
}

AXES = ["dp", "pp", "tp", "sp", "dp_replicate", "dp_shard", "ep"]
ODD_AXES = ["", "d-p", "0"]
PLACEMENTS = ["Shard(0)", "Shard(1)", "Shard(2)", "Shard(-1)", "Replicate", "Partial", "Partial(max)", "S(0)",
              "Shard(x)"]
MODULES = ["tok_embeddings", "layers.0", "layers.1", "layers.2", "layers.3", "layers.4", "norm", "output", "w0", "nope"]
MEGATRON = {  # glob -> the tensor dim tensor parallel shards (column, then row)
    "layers.*.attn.w[qkv].weight": 0,
    "layers.*.attn.wo.weight": 1,
    "layers.*.mlp.w[13].weight": 0,
    "layers.*.mlp.w2.weight": 1,
}
GLOBS = [
    *MEGATRON,
    "layers.0.attn.wq.weight",
    "tok_embeddings.weight",
    "output.weight",
    "layers.*.attn_norm.weight",
    "layers.*.attn_norm",
    "layers.*.mlp_norm",
    "w0",
    "w1",
    "*",
    "nothing.*",
]
SCHEDULES = ["GPipe", "1F1B", "Interleaved1F1B", "InterleavedZeroBubble", "ZBV"]
DP_MODES = ["ddp", "zero1", "fsdp", "zero2", "hsdp"]

INTERESTING_INTS = st.sampled_from([0, -1, 1, 2, 3, 7, 172, 2**31, 2**63, 2**64, 2**70, 10**6])
PLAUSIBLE_TEXT = st.sampled_from(
    AXES + ODD_AXES + PLACEMENTS + MODULES + GLOBS + SCHEDULES + DP_MODES + ["auto", "llama", "mlp", "text"]
)
SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-3, max_value=64),
    st.integers(),
    INTERESTING_INTS,
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12),
    PLAUSIBLE_TEXT,
)
KEYS = st.one_of(st.text(max_size=10), PLAUSIBLE_TEXT)
JSON_VALUES = st.recursive(
    SCALARS,
    lambda children: st.one_of(
        st.lists(children, max_size=4),
        st.dictionaries(KEYS, children, max_size=4),
    ),
    max_leaves=12,
)


def assert_well_formed(raw: Any) -> RunConfig | None:
    """The only allowed outcomes: a RunConfig, or a ConfigError whose issues all say path, reason and fix."""
    try:
        cfg = validate_config(raw)
    except ConfigError as err:
        assert err.issues, "ConfigError without issues"
        for issue in err.issues:
            for field in ("path", "reason", "fix"):
                value = getattr(issue, field)
                assert isinstance(value, str) and value.strip(), f"issue with empty {field}: {issue!r}"
        assert str(err).startswith("invalid config:")
        return None
    assert isinstance(cfg, RunConfig)
    return cfg


# ----------------------------------------------------------------- (a) random values at real paths


def _paths(node: Any, prefix: tuple = ()) -> list[tuple]:
    """Every path to a value inside ``node`` (dict keys and list indices), the root excluded."""
    out = []
    if isinstance(node, dict):
        for key, child in node.items():
            out.append((*prefix, key))
            out += _paths(child, (*prefix, key))
    elif isinstance(node, list):
        for i, child in enumerate(node):
            out.append((*prefix, i))
            out += _paths(child, (*prefix, i))
    return out


def _containers(node: Any, prefix: tuple = ()) -> list[tuple]:
    """Paths of every dict inside ``node`` (the root included): where extra keys can go."""
    out = [prefix] if isinstance(node, dict) else []
    if isinstance(node, dict):
        for key, child in node.items():
            out += _containers(child, (*prefix, key))
    elif isinstance(node, list):
        for i, child in enumerate(node):
            out += _containers(child, (*prefix, i))
    return out


def _get(node: Any, path: tuple) -> Any:
    for part in path:
        node = node[part]
    return node


def _like(old: Any) -> st.SearchStrategy:
    """Values of the old value's type (so the schema accepts them) but of surprising size or content."""
    if isinstance(old, bool):
        return st.booleans()
    if isinstance(old, int):
        return st.one_of(INTERESTING_INTS, st.integers(-3, 64))
    if isinstance(old, float):
        return st.floats(allow_nan=True, allow_infinity=True)
    if isinstance(old, str):
        return st.one_of(PLAUSIBLE_TEXT, st.text(max_size=12))
    if isinstance(old, list):
        return st.lists(st.one_of(PLAUSIBLE_TEXT, st.integers(-1, 8)), max_size=4)
    return JSON_VALUES


@st.composite
def mutated_configs(draw) -> dict[str, Any]:
    base_name = draw(st.sampled_from(sorted(BASES)))
    raw = copy.deepcopy(BASES[base_name])
    for _ in range(draw(st.sampled_from([1, 1, 2, 3]))):
        action = draw(st.sampled_from(["extra_key", "any_value", "same_type", "same_type", "same_type"]))
        if action == "extra_key":
            where = _get(raw, draw(st.sampled_from(_containers(raw))))
            where[draw(KEYS)] = draw(JSON_VALUES)
            continue
        paths = _paths(raw)
        if not paths:
            break
        path = draw(st.sampled_from(paths))
        parent = _get(raw, path[:-1])
        old = parent[path[-1]]
        parent[path[-1]] = draw(JSON_VALUES if action == "any_value" else _like(old))
    return raw


@FUZZ
@given(raw=mutated_configs())
def test_random_values_at_real_paths_never_crash(raw):
    assert_well_formed(raw)


@FUZZ
@given(value=JSON_VALUES)
def test_random_root_never_crashes(value):
    assert_well_formed(value)


@st.composite
def one_leaf_changed(draw) -> dict[str, Any]:
    """One scalar leaf given a value of its own type: passes the schema more often, so it probes
    the structure and model-aware checks (huge sizes, zero, negative, odd strings)."""
    raw = copy.deepcopy(BASES[draw(st.sampled_from(sorted(BASES)))])
    leaves = [p for p in _paths(raw) if not isinstance(_get(raw, p), (dict, list))]
    path = draw(st.sampled_from(leaves))
    parent = _get(raw, path[:-1])
    parent[path[-1]] = draw(_like(parent[path[-1]]))
    return raw


@FUZZ
@given(raw=one_leaf_changed())
def test_one_leaf_changed_never_crashes(raw):
    assert_well_formed(raw)


# ---------------------------------------------------- (b) plausible meshes, dims, placements, stages


def _nest(flat: list, shape: list[int]) -> list:
    if len(shape) <= 1:
        return flat
    step = len(flat) // shape[0]
    return [_nest(flat[i * step:(i + 1) * step], shape[1:]) for i in range(shape[0])]


@st.composite
def coherent_parallel(draw) -> dict[str, Any]:
    """A dp/pp/tp layout that is plausibly right: distinct axis names, one role per axis."""
    raw = copy.deepcopy(BASES["default"])
    is_mlp = draw(st.integers(0, 3)) == 0
    if is_mlp:
        raw["model"] = copy.deepcopy(BASES["mlp_fsdp"]["model"])
        raw["data"] = copy.deepcopy(BASES["mlp_fsdp"]["data"])
    else:
        raw["model"]["n_layers"] = draw(st.integers(1, 6))
        raw["model"]["n_kv_heads"] = draw(st.sampled_from([None, 1, 2, 4]))
    num_axes = draw(st.integers(1, 3))
    names = draw(st.lists(st.sampled_from(AXES), min_size=num_axes, max_size=num_axes, unique=True))
    sizes = draw(st.lists(st.integers(1, 8), min_size=num_axes, max_size=num_axes))
    roles = draw(st.lists(st.sampled_from(["dp", "pp", "tp"]), min_size=num_axes, max_size=num_axes))
    raw["mesh"] = sizes
    par: dict[str, Any] = {"dims": names, "placements": {}, "layouts": {}}
    dp_axes = [n for n, r in zip(names, roles) if r == "dp"]
    if dp_axes:
        mode = "hsdp" if len(dp_axes) == 2 else draw(st.sampled_from(["ddp", "zero1", "fsdp", "zero2"]))
        par["data_parallel"] = {"dim": dp_axes if len(dp_axes) == 2 else dp_axes[0], "mode": mode}
    pp_axes = [n for n, r in zip(names, roles) if r == "pp"]
    if pp_axes:
        schedule = draw(st.sampled_from(SCHEDULES))
        par["pipeline"] = {
            "dim": pp_axes[0],
            "schedule": schedule,
            "microbatches": draw(st.sampled_from([1, 2, 4, 8, 16])),
            "stages_per_rank": 1 if schedule in ("GPipe", "1F1B") else 2,
            "boundaries": draw(st.one_of(st.just("auto"), st.lists(st.sampled_from(MODULES[1:8]), max_size=4))),
        }
    for axis in (n for n, r in zip(names, roles) if r == "tp"):
        if is_mlp:
            par["placements"] = {"w0": {axis: "Shard(1)"}, "w1": {axis: "Shard(0)"}}
        else:
            par["placements"] = {glob: {axis: f"Shard({dim})"} for glob, dim in MEGATRON.items()}
            if draw(st.booleans()):
                par["layouts"] = {"layers.*.attn_norm": {"input": {axis: "Shard(1)"}}}
    raw["parallel"] = par
    raw["train"]["global_batch_size"] = draw(st.sampled_from([1, 2, 4, 8, 12, 16, 32, 64, 128]))
    raw["train"]["grad_accum"] = draw(st.integers(1, 3))
    return raw


def _break(draw, raw: dict[str, Any]) -> None:
    """One plausible mistake, of the kinds users make, applied in place."""
    par = raw["parallel"]
    names = par["dims"]
    shape = raw["mesh"]
    is_shape = isinstance(shape, list) and bool(shape) and all(type(x) is int and x >= 1 for x in shape)
    mesh_breaks = ["mesh_size", "mesh_none", "mesh_ids", "mesh_drop_axis", "mesh_extra_axis", "dims_duplicate"]
    what = draw(st.sampled_from([
        *(mesh_breaks if is_shape else []), "dims_rename", "no_parallel", "dp_dim", "dp_mode", "pp_dim",
        "pp_fields", "boundaries", "placement", "layout", "launch",
    ]))
    if what == "mesh_size":
        raw["mesh"][draw(st.integers(0, len(shape) - 1))] = draw(st.sampled_from([0, -1, 2**31, 172, True, 2.0]))
    elif what == "mesh_none":
        raw["mesh"] = draw(st.sampled_from([None, [], [[]], [[], []]]))
    elif what == "mesh_ids":
        n = math.prod(shape)
        ids = list(draw(st.permutations(range(n)))) if n <= 64 else list(range(n))
        kind = draw(st.sampled_from(["good", "duplicate", "hole", "ragged", "empty_row", "flat_mixed"]))
        if kind == "duplicate" and n > 1:
            ids[-1] = ids[0]
        elif kind == "hole" and ids:
            ids[-1] = n + 3
        mesh: Any = _nest(ids, shape)
        if kind == "ragged" and len(shape) > 1:
            mesh[-1] = mesh[-1][:-1]
        elif kind == "empty_row" and len(shape) > 1:
            mesh[0] = []
        elif kind == "flat_mixed":
            mesh = [*shape[:-1], [0, 1]]
        raw["mesh"] = mesh
    elif what == "mesh_drop_axis":
        raw["mesh"] = raw["mesh"][:-1]
    elif what == "mesh_extra_axis":
        raw["mesh"] = [*raw["mesh"], draw(st.integers(1, 4))]
    elif what == "dims_rename" and names:
        names[draw(st.integers(0, len(names) - 1))] = draw(st.sampled_from(AXES + ODD_AXES))
    elif what == "dims_duplicate":
        names.append(names[0])
        raw["mesh"] = [*raw["mesh"], 2]
    elif what == "no_parallel":
        del raw["parallel"]
    elif what == "dp_dim":
        par["data_parallel"] = {
            "dim": draw(st.one_of(st.sampled_from(AXES), st.lists(st.sampled_from(AXES), max_size=3))),
            "mode": draw(st.sampled_from(DP_MODES)),
        }
    elif what == "dp_mode" and "data_parallel" in par:
        par["data_parallel"]["mode"] = draw(st.sampled_from(DP_MODES))
    elif what == "pp_dim" and "pipeline" in par:
        par["pipeline"]["dim"] = draw(st.sampled_from(AXES))
    elif what == "pp_fields":
        pipeline = par.setdefault("pipeline", {"dim": names[-1] if names else "pp"})
        pipeline["schedule"] = draw(st.sampled_from(SCHEDULES))
        pipeline["microbatches"] = draw(st.integers(1, 16))
        pipeline["stages_per_rank"] = draw(st.integers(1, 3))
    elif what == "boundaries":
        pipeline = par.setdefault("pipeline", {"dim": names[0] if names else "pp"})
        pipeline["boundaries"] = draw(st.one_of(st.just("auto"), st.lists(st.sampled_from(MODULES), max_size=5)))
    elif what == "placement":
        axes = draw(st.dictionaries(st.sampled_from(AXES + ODD_AXES), st.sampled_from(PLACEMENTS), min_size=1,
                                    max_size=2))
        par["placements"][draw(st.sampled_from(GLOBS))] = axes
    elif what == "layout":
        side = draw(st.sampled_from(["input", "output"]))
        axes = draw(st.dictionaries(st.sampled_from(AXES), st.sampled_from(PLACEMENTS), max_size=2))
        par["layouts"][draw(st.sampled_from(GLOBS))] = {side: axes}
    elif what == "launch":
        raw["launch"]["nnodes"] = draw(st.integers(1, 4))
        raw["launch"]["node_rank"] = draw(st.integers(0, 4))


@st.composite
def parallel_configs(draw) -> dict[str, Any]:
    raw = draw(coherent_parallel())
    for _ in range(draw(st.sampled_from([0, 1, 1, 2, 3]))):
        if "parallel" not in raw:
            break
        _break(draw, raw)
    return raw


@FUZZ
@given(raw=parallel_configs())
def test_plausible_parallel_configs_never_crash(raw):
    cfg = assert_well_formed(raw)
    if cfg is None:
        return
    # Whatever passes must be internally consistent: the arithmetic the launcher relies on holds.
    assert cfg.world_size == math.prod(cfg.mesh_shape) >= 1
    assert all(type(size) is int and size >= 1 for size in cfg.mesh_shape)
    split = cfg.dp_size * cfg.num_microbatches * cfg.train.grad_accum
    assert cfg.train.global_batch_size % split == 0
    assert cfg.launch.node_rank < cfg.launch.nnodes and cfg.world_size % cfg.launch.nnodes == 0
    if cfg.parallel is not None:
        assert len(cfg.parallel.dims) == len(cfg.mesh_shape) == len(set(cfg.parallel.dims))
        if cfg.parallel.data_parallel is not None:
            dp_names = cfg.parallel.data_parallel.dim_names
            assert len(set(dp_names)) == len(dp_names) and set(dp_names) <= set(cfg.parallel.dims)
    else:
        assert cfg.world_size == 1


@pytest.mark.parametrize("name", sorted(BASES))
def test_fuzz_bases_are_valid(name):
    """The starting points are valid, so every failure the fuzzers see comes from their mutation."""
    assert isinstance(validate_config(copy.deepcopy(BASES[name])), RunConfig)
