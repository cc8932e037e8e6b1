"""Hardware profiles: every profile in conf/hardware loads with its datasheet numbers, a user adds
one through Hydra's search path, and validation plans a GPU cluster without a GPU but refuses to
run on one that is not there.

Run: ``python -m pytest tests/unit/test_hardware_profiles.py -q``
"""

from __future__ import annotations

import pytest
import torch

from parallel.errors import ConfigError
from trainer.config.compose import CONF_DIR, compose_dict
from trainer.config.schema import RunConfig
from trainer.validate.checks import validate_config

GPU_PROFILES = ["a100_40g", "a100_80g", "b200", "h100_hbm2e", "h100_sxm", "h200"]
NO_GPU = not torch.cuda.is_available()


def _profile(*overrides: str):
    return RunConfig.model_validate(compose_dict(list(overrides))).hardware


def _issues(*overrides: str) -> list:
    try:
        validate_config(compose_dict(list(overrides)), check_model=False)
    except ConfigError as err:
        return err.issues
    return []


def test_the_group_holds_the_profiles_and_this_host_is_the_default():
    assert sorted(p.stem for p in (CONF_DIR / "hardware").glob("*.yaml")) == sorted([*GPU_PROFILES, "this_host"])
    default = _profile()
    assert default.is_host and default.device == "cpu" and default.intra_node is None


@pytest.mark.parametrize("name", GPU_PROFILES)
def test_every_gpu_profile_states_and_cites_every_number(name):
    hw = _profile(f"hardware={name}")
    assert hw.name == name and hw.device == "cuda" and not hw.is_host
    assert hw.missing_gpu_keys() == []
    assert _issues(f"hardware={name}", "dry_run=true") == []
    assert hw.devices_per_node == 8
    for key in ("devices_per_node", "memory_gb", "memory_bandwidth_gb_s", "peak_tflops", "power_w",
                "intra_node", "inter_node"):
        assert len(hw.sources[key]) > 40, f"{name}: sources.{key} cites nothing"
    for part in (hw.intra_node, hw.inter_node, hw.runtime_memory):
        assert "nccl" in part.source.lower() or "measured" in part.source
    assert hw.intra_node.bandwidth_gb_s > hw.inter_node.bandwidth_gb_s  # NVLink beats one NIC
    assert hw.peak_tflops["bf16"] > hw.peak_tflops["fp32"]


@pytest.mark.parametrize(("name", "memory_gb", "bandwidth", "bf16", "fp8", "nvlink", "nic"), [
    ("a100_40g", 40, 1555, 312, None, 240.0, 25.0),       # A100 datasheet; 12 NVLinks x 20 GB/s; HDR 200 Gb/s
    ("a100_80g", 80, 2039, 312, None, 240.0, 25.0),
    ("h100_sxm", 80, 3350, 989.5, 1979, 370.8, 50.0),     # H100 datasheet / 2 (dense); 18 x 20.6; NDR 400 Gb/s
    ("h100_hbm2e", 96, 2400, 886.8, 1773.3, 370.8, 50.0),  # interpolated at 500 W (see its sources)
    ("h200", 141, 4800, 989.5, 1979, 370.8, 50.0),
    ("b200", 180, 7700, 2250, 4500, 721.8, 50.0),         # HGX B200 / 2 (dense); 18 x 40.1; ConnectX-7 400 Gb/s
])
def test_profile_numbers(name, memory_gb, bandwidth, bf16, fp8, nvlink, nic):
    hw = _profile(f"hardware={name}")
    assert (hw.memory_gb, hw.memory_bandwidth_gb_s, hw.peak_tflops["bf16"]) == (memory_gb, bandwidth, bf16)
    assert hw.peak_tflops.get("fp8") == fp8
    assert (hw.intra_node.bandwidth_gb_s, hw.inter_node.bandwidth_gb_s) == (nvlink, nic)
    assert hw.memory_bytes == memory_gb * 1e9
    assert hw.peak_flops("bf16") == bf16 * 1e12


def test_peak_flops_of_a_dtype_the_profile_does_not_state():
    with pytest.raises(KeyError, match="states no peak_tflops.fp8"):
        _profile("hardware=a100_80g").peak_flops("fp8")


def test_a_key_can_be_overridden_like_any_other():
    assert _profile("hardware=h100_sxm", "hardware.inter_node.bandwidth_gb_s=25").inter_node.bandwidth_gb_s == 25


def test_an_unknown_dtype_is_refused_by_name():
    issues = _issues("hardware=h100_sxm", "dry_run=true", "hardware.peak_tflops.fp4=9000")
    assert [i.path for i in issues] == ["hardware.peak_tflops.fp4"]


def _user_profile(tmp_path) -> str:
    """``<tmp>/hardware/my_gpu.yaml``: the H100 SXM profile renamed, with 64 GB."""
    (tmp_path / "hardware").mkdir()
    text = (CONF_DIR / "hardware" / "h100_sxm.yaml").read_text()
    text = text.replace("name: h100_sxm", "name: my_gpu").replace("memory_gb: 80\n", "memory_gb: 64\n")
    (tmp_path / "hardware" / "my_gpu.yaml").write_text(text)
    return f"hydra.searchpath=[file://{tmp_path}]"


def test_a_user_profile_through_the_search_path(tmp_path):
    hw = _profile("hardware=my_gpu", _user_profile(tmp_path))
    assert (hw.name, hw.memory_gb, hw.peak_tflops["bf16"]) == ("my_gpu", 64, 989.5)


def test_an_incomplete_user_profile_names_every_missing_key(tmp_path):
    (tmp_path / "hardware").mkdir()
    (tmp_path / "hardware" / "half.yaml").write_text("name: half\ndevice: cuda\nmemory_gb: 24\n"
                                                     "peak_tflops: {bf16: 100}\n")
    issues = _issues("hardware=half", f"hydra.searchpath=[file://{tmp_path}]", "dry_run=true")
    assert [i.path for i in issues] == ["hardware.devices_per_node", "hardware.memory_bandwidth_gb_s",
                                        "hardware.intra_node", "hardware.inter_node", "hardware.runtime_memory",
                                        "hardware.sm_count", "hardware.achieved", "hardware.peak_tflops.fp32"]
    assert "hardware.sm_count=132" in issues[5].fix and "'hardware.achieved={matmul: 0.79" in issues[6].fix
    assert "hardware.devices_per_node=8" in issues[0].fix


def test_planning_a_cluster_needs_no_gpu_and_no_rendezvous():
    """The issue's example, as a dry run on this host: no device, no rendezvous port, 32 nodes of 8."""
    assert _issues("dry_run=true", "hardware=h100_sxm", "launch.nnodes=32", "+parallel=3d", "mesh=[8,4,8]",
                   "train.global_batch_size=64") == []
    assert _issues("dry_run=true", "hardware=h100_sxm", "device=cuda") == []


@pytest.mark.skipif(not NO_GPU, reason="a host with a GPU runs it")
def test_a_real_run_on_a_gpu_profile_needs_its_hardware():
    issues = _issues("hardware=h100_sxm")
    assert [i.path for i in issues] == ["hardware"]
    assert issues[0].fix == "add dry_run=true to plan it, or run on that hardware"
    assert [i.path for i in _issues("device=cuda", "dry_run=true")] == ["device"]  # this_host: still this host's GPU


def test_nodes_must_hold_the_mesh():
    issues = _issues("dry_run=true", "hardware=h100_sxm", "+parallel=fsdp", "mesh=[512]", "train.global_batch_size=512")
    assert [(i.path, i.fix.split(" (")[0]) for i in issues] == [("launch.nnodes", "use launch.nnodes=64")]
    assert "512 workers on 1 node(s) is 512 per node" in issues[0].reason
    # 12 workers of 8-GPU nodes: 2 nodes of 6 (nodes must divide the world)
    issues = _issues("dry_run=true", "hardware=a100_80g", "+parallel=fsdp", "mesh=[12]", "train.global_batch_size=12")
    assert issues[0].fix.startswith("use launch.nnodes=2 (6 per node)")
    assert _issues("dry_run=true", "hardware=a100_80g", "+parallel=fsdp", "mesh=[12]", "train.global_batch_size=12",
                   "launch.nnodes=2") == []


@pytest.mark.skipif(not NO_GPU, reason="the refusal needs a host without a GPU")
def test_the_cli_plans_a_user_profile_and_refuses_to_run_it(tmp_path):
    """Through ``python -m trainer`` as typed: a user's profile validates as a dry run, exit 0; the same
    config as a run is refused with exit code 2 and the printed fix."""
    from tests.conftest import run_cli

    search = _user_profile(tmp_path)
    planned = run_cli(["hardware=my_gpu", search, "dry_run=true", "validate_only=true"], cwd=tmp_path)
    assert planned.returncode == 0 and planned.stdout.startswith("config OK"), planned.stderr
    refused = run_cli(["hardware=my_gpu", search, "validate_only=true"], cwd=tmp_path)
    assert refused.returncode == 2, refused.stderr
    assert "  - hardware: profile 'my_gpu' describes cuda devices" in refused.stderr
    assert "(add dry_run=true to plan it, or run on that hardware)" in refused.stderr
