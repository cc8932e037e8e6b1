"""Every config knob that spends disk, CPU, time or memory has a ceiling (and a floor where a tiny
value spends CPU), stated in ``python -m trainer --help`` and refused with the path, the bound and a
fix that is the bound itself, typed as an override (issue 36, item 6).

Run: ``python -m pytest tests/conf/test_ceilings.py -q``
"""

from __future__ import annotations

import contextlib
import io

import pytest
from pydantic import ValidationError

from trainer.cli.help import print_help
from trainer.config.schema import RunConfig
from trainer.validate.schema_issues import schema_issues

# (config path, the section it needs (tag keys), a value past the bound, the bound, which side)
KNOBS = [
    ("train.checkpoint.keep", {}, 1_000_000, 1000, "<="),
    ("tracking.system_metrics_interval", {}, 0.001, 1, ">="),
    ("tracking.system_metrics_interval", {}, 10**6, 3600, "<="),
    ("tracking.timeline_steps", {}, 1_000_000, 1000, "<="),
    ("launch.rdzv_timeout_s", {}, 1e9, 86400, "<="),
    ("launch.max_restarts", {}, 10**6, 100, "<="),
    ("data.max_bytes", {"data.kind": "text"}, 10**12, 2**30, "<="),
    ("data.num_tokens", {"data.kind": "synthetic"}, 10**12, 2**27, "<="),
    ("data.num_samples", {"data.kind": "regression"}, 10**12, 2**27, "<="),
    ("train.steps", {}, 10**12, 10**8, "<="),
    ("train.global_batch_size", {}, 10**9, 2**20, "<="),
    ("train.seq_len", {}, 10**9, 2**24, "<="),
    ("train.grad_accum", {}, 10**9, 65536, "<="),
    ("train.eval_batches", {}, 10**9, 10_000, "<="),
    ("train.progress_every_s", {}, 10**9, 86400, "<="),
    ("model.max_seq_len", {"model.arch": "llama"}, 10**9, 2**24, "<="),
    ("parallel.pipeline.microbatches", {"parallel.dims": ["pp"]}, 10**9, 4096, "<="),
    ("parallel.pipeline.stages_per_rank", {"parallel.dims": ["pp"]}, 10**9, 64, "<="),
    ("parallel.auto.max_microbatches", {"parallel.dims": ["dp"]}, 10**9, 1024, "<="),
]
IDS = [f"{path}{side}{bound}" for path, _, _, bound, side in KNOBS]


def _doc(path: str, value, section: dict[str, str]) -> dict:
    doc: dict = {}
    for key, val in [*section.items(), (path, value)]:
        *parents, leaf = key.split(".")
        node = doc
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = val
    return doc


@pytest.mark.parametrize(("path", "section", "value", "bound", "side"), KNOBS, ids=IDS)
def test_a_knob_past_its_bound_is_refused_with_the_bound_as_the_fix(path, section, value, bound, side):
    with pytest.raises(ValidationError) as caught:
        RunConfig.model_validate(_doc(path, value, section))
    (issue,) = schema_issues(caught.value, _doc(path, value, section))
    words = "less than or equal to" if side == "<=" else "greater than or equal to"
    assert issue.path == path and f"{words} {bound}" in issue.reason, issue
    assert issue.fix == f"use a value in the allowed range ({side} {bound}): {path}={bound}"
    # the fix, typed as printed: the bound itself is valid
    assert RunConfig.model_validate(_doc(path, bound, section)) is not None


def test_the_bounds_are_in_the_help():
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        print_help()
    lines = {line.split(":")[0].strip(): line for line in out.getvalue().splitlines() if ": " in line}
    for path, _, _, bound, side in KNOBS:
        assert f"{side} {bound}" in lines[path], lines[path]
    assert lines["tracking.system_metrics_interval"].endswith("[>= 1, <= 3600]")
    assert lines["optim.lr"].endswith("[> 0]")  # every range pydantic enforces, not only the new ones


def test_an_open_bound_names_no_override_it_cannot_spell():
    """``optim.lr=0`` (``> 0`` on a float): no nearest value to print, so the bound alone."""
    raw = {"optim": {"lr": 0}}
    with pytest.raises(ValidationError) as caught:
        RunConfig.model_validate(raw)
    (issue,) = schema_issues(caught.value, raw)
    assert (issue.path, issue.fix) == ("optim.lr", "use a value in the allowed range (> 0)")
