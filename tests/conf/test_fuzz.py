"""Property tests of the validator: whatever a user (or a REST client) sends, it either returns a
RunConfig or raises ConfigError whose every issue names a path, a reason and a fix. Any other
exception is a crash of the validator and fails the test.

Run: ``python -m pytest tests/conf/test_fuzz.py -q``
"""

from __future__ import annotations

import copy
import math
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from trainer.compose import compose_dict
from trainer.config import RunConfig
from trainer.errors import ConfigError
from trainer.validate import validate_config

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
    "explicit_ids": compose_dict(["+parallel=2d", "mesh=[[3,1],[0,2]]", "model=gpt_small"]),
}
for _name, _raw in BASES.items():  # a broken base would make every example meaningless
    validate_config(copy.deepcopy(_raw))

AXES = ["dp", "pp", "tp", "sp", "dp_replicate", "dp_shard", "ep", ""]
PLACEMENTS = ["Shard(0)", "Shard(1)", "Shard(2)", "Shard(-1)", "Replicate", "Partial", "Partial(max)", "S(0)", "Shard(x)"]
MODULES = ["tok_embeddings", "layers.0", "layers.1", "layers.2", "layers.3", "layers.4", "norm", "output", "w0", "nope"]
GLOBS = [
    "layers.*.attn.w[qkv].weight",
    "layers.*.attn.wo.weight",
    "layers.*.mlp.w[13].weight",
    "layers.*.mlp.w2.weight",
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
DP_MODES = ["ddp", "fsdp", "zero2", "hsdp"]

PLAUSIBLE_TEXT = st.sampled_from(AXES + PLACEMENTS + MODULES + GLOBS + SCHEDULES + DP_MODES + ["auto", "llama", "mlp"])
SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-3, max_value=64),
    st.integers(),
    st.sampled_from([0, -1, 2**31, 2**63, 2**64, 2**70, 10**6]),  # past int32, int64, and merely huge
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


@st.composite
def mutated_configs(draw) -> dict[str, Any]:
    base_name = draw(st.sampled_from(sorted(BASES)))
    raw = copy.deepcopy(BASES[base_name])
    for _ in range(draw(st.integers(min_value=1, max_value=3))):
        if draw(st.integers(0, 3)) == 0:  # an extra key in some section
            containers = _containers(raw)
            where = _get(raw, draw(st.sampled_from(containers)))
            where[draw(KEYS)] = draw(JSON_VALUES)
        else:  # replace an existing value (a section, a list, a leaf)
            paths = _paths(raw)
            if not paths:
                break
            path = draw(st.sampled_from(paths))
            _get(raw, path[:-1])[path[-1]] = draw(JSON_VALUES)
    return raw


@FUZZ
@given(raw=mutated_configs())
def test_random_values_at_real_paths_never_crash(raw):
    assert_well_formed(raw)


@FUZZ
@given(value=JSON_VALUES)
def test_random_root_never_crashes(value):
    assert_well_formed(value)


# ---------------------------------------------------- (b) plausible meshes, dims, placements, stages


@st.composite
def parallel_configs(draw) -> dict[str, Any]:
    raw = copy.deepcopy(BASES["default"])
    if draw(st.booleans()):
        raw["model"] = copy.deepcopy(BASES["mlp_fsdp"]["model"])
        raw["data"] = copy.deepcopy(BASES["mlp_fsdp"]["data"])
    else:
        raw["model"]["n_layers"] = draw(st.integers(1, 6))
        raw["model"]["n_kv_heads"] = draw(st.sampled_from([None, 1, 2, 4]))

    num_axes = draw(st.integers(0, 3))
    shape = draw(st.lists(st.integers(0, 8), min_size=num_axes, max_size=num_axes))
    mesh_kind = draw(st.sampled_from(["shape", "shape", "ids", "none"]))
    if mesh_kind == "none":
        mesh: Any = None
    elif mesh_kind == "ids" and shape and 0 < math.prod(shape) <= 64:
        ids = draw(st.permutations(range(math.prod(shape))))
        if draw(st.integers(0, 4)) == 0:  # sometimes a duplicate or a hole
            ids = [*ids[:-1], draw(st.integers(-1, len(ids)))]
        mesh = _nest(list(ids), shape)
        if draw(st.integers(0, 4)) == 0 and isinstance(mesh, list) and mesh and isinstance(mesh[-1], list):
            mesh[-1] = mesh[-1][:-1]  # a ragged row
    else:
        mesh = shape
    raw["mesh"] = mesh

    if draw(st.integers(0, 5)):
        axis_names = draw(st.lists(st.sampled_from(AXES), min_size=0, max_size=4))
        par: dict[str, Any] = {"dims": axis_names}
        if draw(st.booleans()):
            mode = draw(st.sampled_from(DP_MODES))
            dim = draw(st.one_of(st.sampled_from(AXES), st.lists(st.sampled_from(AXES), max_size=3)))
            par["data_parallel"] = {"dim": dim, "mode": mode}
        if draw(st.booleans()):
            par["pipeline"] = {
                "dim": draw(st.sampled_from(AXES)),
                "schedule": draw(st.sampled_from(SCHEDULES)),
                "microbatches": draw(st.integers(1, 16)),
                "stages_per_rank": draw(st.integers(1, 3)),
                "boundaries": draw(st.one_of(st.just("auto"), st.lists(st.sampled_from(MODULES), max_size=5))),
            }
        par["placements"] = draw(
            st.dictionaries(
                st.sampled_from(GLOBS),
                st.dictionaries(st.sampled_from(AXES), st.sampled_from(PLACEMENTS), max_size=2),
                max_size=4,
            )
        )
        par["layouts"] = draw(
            st.dictionaries(
                st.sampled_from(GLOBS),
                st.fixed_dictionaries(
                    {},
                    optional={
                        "input": st.dictionaries(st.sampled_from(AXES), st.sampled_from(PLACEMENTS), max_size=2),
                        "output": st.dictionaries(st.sampled_from(AXES), st.sampled_from(PLACEMENTS), max_size=2),
                    },
                ),
                max_size=2,
            )
        )
        raw["parallel"] = par
    raw["train"]["global_batch_size"] = draw(st.sampled_from([1, 2, 4, 8, 12, 16, 32, 64]))
    raw["train"]["grad_accum"] = draw(st.integers(1, 3))
    raw["launch"]["nnodes"] = draw(st.sampled_from([1, 1, 1, 2, 3]))
    raw["launch"]["node_rank"] = draw(st.integers(0, 3))
    return raw


def _nest(flat: list, shape: list[int]) -> list:
    if len(shape) <= 1:
        return flat
    step = len(flat) // shape[0]
    return [_nest(flat[i * step:(i + 1) * step], shape[1:]) for i in range(shape[0])]


@FUZZ
@given(raw=parallel_configs())
def test_plausible_parallel_configs_never_crash(raw):
    cfg = assert_well_formed(raw)
    if cfg is None:
        return
    # Whatever passes must be internally consistent: the arithmetic the launcher relies on holds.
    assert cfg.world_size == math.prod(cfg.mesh_shape) >= 1
    split = cfg.dp_size * cfg.num_microbatches * cfg.train.grad_accum
    assert cfg.train.global_batch_size % split == 0
    assert cfg.launch.node_rank < cfg.launch.nnodes and cfg.world_size % cfg.launch.nnodes == 0
    if cfg.parallel is not None:
        assert len(cfg.parallel.dims) == len(cfg.mesh_shape) == len(set(cfg.parallel.dims))


@pytest.mark.parametrize("name", sorted(BASES))
def test_fuzz_bases_are_valid(name):
    """The starting points are valid, so every failure the fuzzers see comes from their mutation."""
    assert isinstance(validate_config(copy.deepcopy(BASES[name])), RunConfig)
