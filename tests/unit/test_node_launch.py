"""What each node of a several-host run decides on its own: the shared rendezvous id, its ranks,
and the per-node options of ``python -m trainer.launch``."""

from __future__ import annotations

import pytest

from trainer.config.schema import RunConfig
from trainer.launch.launcher import _with_node_options, main
from trainer.launch.tracked import rendezvous_id
from trainer.launch.worker import node_ordered_rank

TWO_NODES = {"mesh": [4], "parallel": {"dims": ["dp"], "data_parallel": {"dim": "dp", "mode": "fsdp"}},
             "launch": {"nnodes": 2, "rdzv_endpoint": "10.0.0.1:29500"}}


def _cfg(**launch) -> RunConfig:
    return RunConfig.model_validate({**TWO_NODES, "launch": {**TWO_NODES["launch"], **launch}})


def test_every_node_of_a_config_derives_the_same_rendezvous_id_and_another_config_another():
    ids = {rendezvous_id(_cfg(node_rank=r, local_addr=f"10.0.0.{r + 1}", log_dir=f"logs{r}")) for r in (0, 1)}
    assert len(ids) == 1
    assert rendezvous_id(_cfg(node_rank=0)) != rendezvous_id(_cfg(node_rank=0, rdzv_endpoint="10.0.0.1:29501"))
    assert rendezvous_id(_cfg(rdzv_id="job-42")) == "job-42"
    one = RunConfig.model_validate({"mesh": [2], "parallel": TWO_NODES["parallel"]})
    assert rendezvous_id(one) != rendezvous_id(one)  # one host: a fresh id per run


def test_ranks_are_numbered_by_node_then_local_rank():
    assert [node_ordered_rank(_cfg(node_rank=n), local, 2) for n in (0, 1) for local in (0, 1)] == [0, 1, 2, 3]


def test_node_options_override_the_launch_section(monkeypatch):
    class Args:
        node_rank, node_rank_env, rdzv_endpoint, rdzv_id, local_addr = (None, "JOB_COMPLETION_INDEX", "h0:29400",
                                                                         "j7", None)
        resume = run_id = None  # a Slurm requeue's options: not given here

    monkeypatch.setenv("JOB_COMPLETION_INDEX", "1")
    cfg = _with_node_options(_cfg(), Args)
    assert (cfg.launch.node_rank, cfg.launch.rdzv_endpoint, cfg.launch.rdzv_id) == (1, "h0:29400", "j7")
    monkeypatch.setenv("JOB_COMPLETION_INDEX", "2")
    with pytest.raises(ValueError, match=r"launch.node_rank: 2 is not below launch.nnodes 2"):
        _with_node_options(_cfg(), Args)
    monkeypatch.setenv("JOB_COMPLETION_INDEX", "")
    with pytest.raises(ValueError, match="--node-rank-env JOB_COMPLETION_INDEX: the variable is ''"):
        _with_node_options(_cfg(), Args)


def test_a_bad_node_option_is_a_config_error_that_names_the_field(tmp_path, capsys):
    path = tmp_path / "job.json"
    path.write_text(_cfg().model_dump_json())
    assert main([str(path), "--node-rank", "5"]) == 2
    assert "launch.node_rank: 5 is not below launch.nnodes 2" in capsys.readouterr().err


def test_several_hosts_need_a_fixed_rendezvous_port():
    from trainer.validate.launch_checks import check_launch

    (issue,) = check_launch(_cfg(rdzv_endpoint="10.0.0.1:0"))
    assert issue.path == "launch.rdzv_endpoint" and "port 0 with launch.nnodes=2" in str(issue)
    (issue,) = check_launch(_cfg(rdzv_endpoint="10.0.0.1"))
    assert "is not host:port" in str(issue)
