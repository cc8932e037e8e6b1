"""The pieces of "nothing lost at the end of a run", without processes: the launcher's check of the
checkpoint directory, what several nodes are told about theirs, the record of a failure after the last
step, and the gather on one device.

    python -m pytest tests/unit/test_end_of_run_checks.py -q
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from parallel.sharding.gather import full_state_on_rank0
from trainer.config.compose import compose_dict
from trainer.config.schema import RunConfig
from trainer.tracking.end_of_run import ERRORS_TAG, AfterTraining, error_lines
from trainer.tracking.run_record import summary
from trainer.tracking.tracker import NullTracker, Terminated
from trainer.validate.launch_checks import check_launch
from trainer.launch.disk_checks import checkpoint_sharing_warning, free_dir, launch_disk_issues


def _cfg(*overrides: str) -> RunConfig:
    return RunConfig.model_validate(compose_dict(list(overrides)))


def _finished(folder: Path, step: int) -> None:
    (folder / f"step_{step:08d}").mkdir(parents=True)
    (folder / f"step_{step:08d}" / "COMPLETE").touch()


def test_a_fresh_run_is_refused_a_directory_holding_another_runs_checkpoints(tmp_path):
    ckpt = tmp_path / "checkpoints"
    assert launch_disk_issues(_cfg(f"train.checkpoint.dir={ckpt}")) == []  # nothing there yet
    (ckpt / ".tmp-step_00000004-0badc0de").mkdir(parents=True)  # a save killed before its rename: no checkpoint
    assert launch_disk_issues(_cfg(f"train.checkpoint.dir={ckpt}")) == []
    for step in (10, 20, 30, 40):
        _finished(ckpt, step)
    (issue,) = launch_disk_issues(_cfg(f"train.checkpoint.dir={ckpt}"))
    assert issue.path == "train.checkpoint.dir"
    assert issue.reason == (f"{str(ckpt)!r} already holds another run's checkpoints (step_00000020, step_00000030, "
                            "step_00000040 and 1 more); this run starts afresh and would replace them or, past "
                            "train.checkpoint.keep, delete them")
    assert issue.fix == ("continue that run with train.checkpoint.resume=auto, or give this one a directory of its "
                         f"own: train.checkpoint.dir={ckpt}-2")
    # what does not write there, or continues what is there, starts
    for fine in (["train.checkpoint.resume=auto"], ["train.checkpoint.save_final=false"], ["dry_run=true"],
                 ["validate_only=true"]):
        assert launch_disk_issues(_cfg(f"train.checkpoint.dir={ckpt}", *fine)) == [], fine


def test_the_free_directory_skips_used_ones(tmp_path):
    _finished(tmp_path / "checkpoints-2", 5)
    (tmp_path / "checkpoints-3").mkdir()  # there, but holding no checkpoint: free
    assert free_dir(str(tmp_path / "checkpoints")) == f"{tmp_path}/checkpoints-3"
    assert free_dir(str(tmp_path / "checkpoints") + "/") == f"{tmp_path}/checkpoints-3"


TWO_NODES = ["+parallel=dp", "mesh=[2]", "launch.nnodes=2", "launch.rdzv_endpoint=10.0.0.1:29500"]


def test_several_nodes_resuming_from_a_relative_directory_are_refused_and_warned_otherwise():
    assert checkpoint_sharing_warning(_cfg()) is None and checkpoint_sharing_warning(
        _cfg(*TWO_NODES, "train.checkpoint.dir=/mnt/shared/checkpoints")) is None
    warning = checkpoint_sharing_warning(_cfg(*TWO_NODES))
    assert warning.startswith("warning: train.checkpoint.dir=checkpoints is relative: each of the 2 nodes saves its "
                              f"own ranks' shards under its own working directory ({Path('checkpoints').resolve()} ")
    assert "train.checkpoint.dir=/mnt/shared/checkpoints" in warning
    assert [i for i in check_launch(_cfg(*TWO_NODES)) if i.path == "train.checkpoint.dir"] == []
    (restarts,) = [i for i in check_launch(_cfg(*TWO_NODES, "launch.max_restarts=2"))
                   if i.path == "train.checkpoint.dir"]
    assert "launch.max_restarts=2 (a restart resumes from the latest checkpoint) needs every shard" in restarts.reason
    assert restarts.fix.endswith("e.g. train.checkpoint.dir=/mnt/shared/checkpoints")
    assert [i for i in check_launch(_cfg(*TWO_NODES, "launch.max_restarts=2", "train.checkpoint.dir=/mnt/shared/c"))
            if i.path == "train.checkpoint.dir"] == []


class Recorder(NullTracker):
    """A tracker that keeps its tags (and can fail on them, as an unreachable store does)."""

    def __init__(self, *, fail: bool = False) -> None:
        self.tags: dict[str, str] = {}
        self.fail = fail

    def set_tag(self, key: str, value) -> None:
        if self.fail:
            raise ConnectionError("store unreachable")
        self.tags[key] = value


def test_a_failure_after_training_is_one_line_recorded_and_swallowed_unless_required():
    said, tracker = [], Recorder()
    after = AfterTraining(tracker, say=said.append, errors=["the timeline pictures: ValueError: no events"])
    with after.guard("the final model (MLflow model/)"):
        raise OSError(28, "No space left on device\non /tmp")
    error = "the final model (MLflow model/): OSError: [Errno 28] No space left on device on /tmp"
    assert after.errors == ["the timeline pictures: ValueError: no events", error]
    assert said == [f"after training: {error} (the training itself finished)"]
    assert tracker.tags == {ERRORS_TAG: f"the timeline pictures: ValueError: no events; {error}"}
    with pytest.raises(OSError), after.guard("the final model", required=True):
        raise OSError("asked for")
    with pytest.raises(Terminated), after.guard("the final model"):  # a stop is never swallowed
        raise Terminated()
    failing = AfterTraining(Recorder(fail=True), say=said.append)
    with failing.guard("the placement picture"):
        raise RuntimeError("boom")
    assert failing.errors == ["the placement picture: RuntimeError: boom"]  # the line is said, the tag lost


def test_the_summary_ends_with_what_failed_after_training():
    outcome = {"losses": [5.0, 4.0], "first_step": 0, "step_times": [0.1, 0.1], "tokens_per_step": 64,
               "end_of_run_errors": ["the final model (MLflow model/): OSError: disk full"]}
    text = summary(_cfg("tracking=none"), outcome, NullTracker(), wall_s=1.0)
    assert text.splitlines()[-1] == "  not done after training: the final model (MLflow model/): OSError: disk full"
    assert error_lines([]) == []


def test_the_gather_without_a_process_group_is_the_modules_own_tensors():
    module = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.LayerNorm(2))
    state = full_state_on_rank0(module)
    assert state.keys() == module.state_dict().keys()
    assert all(state[k].equal(v) and state[k].device.type == "cpu" for k, v in module.state_dict().items())
