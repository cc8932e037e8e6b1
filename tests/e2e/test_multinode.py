"""Two hosts, one run: two launchers (``launch.nnodes=2``, 2 workers each) meet at node 0's
rendezvous and train as one mesh, with the same losses as one device.

The two "hosts" are two network namespaces joined by a veth pair (10.77.<n>.1 and .2), each with
its own address, when this machine lets the test make them (root and ``ip``); otherwise both run
on loopback, and the test says so. Node 0 owns the MLflow run; node 1 logs nothing of its own.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from tests.ports import free_port
from timing import Deadline, scaled

COMMON = ["train.steps=4", "train.global_batch_size=8", "train.seq_len=32", "data.max_bytes=100000",
          "train.log_every=1", "tracking.pictures=false"]
# The rendezvous waits for the slower node: 120 s on an idle host, scaled (tests/timing.py).
TWO_NODES = ["+parallel=fsdp", "mesh=[4]", "launch.nnodes=2", f"launch.rdzv_timeout_s={scaled(120):.0f}"]


class Hosts:
    """Where each node runs: a command prefix, its address and the environment gloo needs there."""

    def __init__(self) -> None:
        self.names: list[str] = []
        self.addresses = ["127.0.0.1", "127.0.0.1"]
        self.prefixes: list[list[str]] = [[], []]
        self.envs: list[dict[str, str]] = [{}, {}]

    def make_namespaces(self) -> bool:
        """Two namespaces with a veth pair between them; False (and nothing left) if not allowed."""
        if os.geteuid() != 0 or shutil.which("ip") is None:
            return False
        tag = uuid.uuid4().hex[:6]
        names, links = [f"mf{tag}a", f"mf{tag}b"], [f"v{tag}a", f"v{tag}b"]
        subnet = int(tag, 16) % 250 + 1
        addresses = [f"10.77.{subnet}.1", f"10.77.{subnet}.2"]
        steps = [["ip", "netns", "add", names[0]], ["ip", "netns", "add", names[1]],
                 ["ip", "link", "add", links[0], "type", "veth", "peer", "name", links[1]]]
        for name, link, address in zip(names, links, addresses):
            steps += [["ip", "link", "set", link, "netns", name],
                      ["ip", "-n", name, "addr", "add", f"{address}/24", "dev", link],
                      ["ip", "-n", name, "link", "set", link, "up"], ["ip", "-n", name, "link", "set", "lo", "up"]]
        self.names = names
        for step in steps:
            if subprocess.run(step, capture_output=True).returncode != 0:
                self.remove()
                return False
        self.addresses = addresses
        self.prefixes = [["ip", "netns", "exec", name] for name in names]
        self.envs = [{"GLOO_SOCKET_IFNAME": link} for link in links]
        return True

    def remove(self) -> None:
        for name in self.names:  # deleting a namespace deletes its end of the veth pair, and so both
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
        self.names = []


@pytest.fixture(scope="module")
def hosts():
    made = Hosts()
    if not made.make_namespaces():
        print("two network namespaces could not be made here: both nodes run on loopback")
    yield made
    made.remove()


def _start_nodes(hosts: Hosts, cwd: Path | list[Path], args: list[str]) -> list[subprocess.Popen]:
    """Node 0 and node 1 of one run, in ``cwd`` (one folder for both, or each its own: no shared disk)."""
    endpoint = f"{hosts.addresses[0]}:{free_port()}"
    cwds = cwd if isinstance(cwd, list) else [cwd, cwd]
    procs = []
    for node in (1, 0):  # node 1 first: it waits for node 0's store, as on a real cluster
        command = [*hosts.prefixes[node], sys.executable, "-m", "trainer", *args, f"launch.node_rank={node}",
                   f"launch.rdzv_endpoint={endpoint}", f"launch.local_addr={hosts.addresses[node]}"]
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **hosts.envs[node]}
        procs.append(subprocess.Popen(command, cwd=cwds[node], env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True, start_new_session=True))
    return procs[::-1]  # [node 0, node 1]


def _finish(procs: list[subprocess.Popen], timeout: float) -> list[str]:
    outputs = []
    for proc in procs:
        try:
            outputs.append(proc.communicate(timeout=scaled(timeout))[0])
        except subprocess.TimeoutExpired:
            for p in procs:
                os.killpg(p.pid, signal.SIGKILL)
            raise
    return outputs


def _runs(uri: str) -> list:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    return client.search_runs([client.get_experiment_by_name("meshflow").experiment_id])


def _losses(uri: str) -> dict[int, float]:
    from mlflow.tracking import MlflowClient

    (run,) = _runs(uri)
    return {m.step: m.value for m in MlflowClient(tracking_uri=uri).get_metric_history(run.info.run_id, "loss")}


@pytest.mark.slow
def test_two_nodes_train_as_one_mesh_with_one_devices_losses(hosts, tmp_path):
    single_dir, nodes_dir = tmp_path / "single", tmp_path / "nodes"
    single_dir.mkdir(), nodes_dir.mkdir()
    single_uri, nodes_uri = f"sqlite:///{single_dir}/mlflow.db", f"sqlite:///{nodes_dir}/mlflow.db"
    single = subprocess.run([sys.executable, "-m", "trainer", *COMMON, f"tracking.tracking_uri={single_uri}"],
                            cwd=single_dir, capture_output=True, text=True, timeout=scaled(300))
    assert single.returncode == 0, single.stdout[-2000:] + single.stderr[-2000:]

    node0, node1 = _finish(_start_nodes(hosts, nodes_dir, [*TWO_NODES, *COMMON, f"tracking.tracking_uri={nodes_uri}"]),
                           timeout=400)
    assert "done: steps 1..4" in node0, node0[-3000:]
    assert "node 0 of 2: workers rank 0..1" in node0 and "node 1 of 2: workers rank 2..3" in node1, node1[-3000:]
    assert "node 1 of 2: its 2 workers finished" in node1 and "done:" not in node1 and "step 1/4" not in node1
    assert "[node0.0]: step 4/4" in node0  # rank 0 (node 0's local rank 0) shows the progress
    want, got = _losses(single_uri), _losses(nodes_uri)  # one MLflow run: node 1 made none
    assert sorted(got) == sorted(want) == [1, 2, 3, 4]
    assert max(abs(got[s] - want[s]) / abs(want[s]) for s in want) <= 1e-5, (got, want)
    if hosts.names:  # each node's workers listened on its own address: rank 0's line says where it ran
        assert hosts.addresses[0] != hosts.addresses[1]


@pytest.mark.slow
def test_two_nodes_without_a_shared_disk_finish_and_log_the_model_they_trained(hosts, tmp_path):
    """Each launcher in its own folder (node-local checkpoints, as hosts without a shared disk): both
    exit 0; the final model, gathered over the network, loads in transformers with the trained model's
    logits (the checkpoint's, made whole by putting node 1's shards beside node 0's)."""
    import torch
    from mlflow.tracking import MlflowClient
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from trainer.export.weights import load_checkpoint_model

    folders = [tmp_path / "node0", tmp_path / "node1"]
    for folder in folders:
        folder.mkdir()
    uri = f"sqlite:///{tmp_path}/mlflow.db"  # node 0 logs; node 1 makes no run
    procs = _start_nodes(hosts, folders, [*TWO_NODES, *COMMON, f"tracking.tracking_uri={uri}"])
    node0, node1 = _finish(procs, timeout=400)
    assert [p.returncode for p in procs] == [0, 0], (node0[-3000:], node1[-3000:])
    assert "done: steps 1..4" in node0 and "final model: model/model.safetensors and model/hf/" in node0, node0[-3000:]
    for out in (node0, node1):  # each node learns before the run that its checkpoints are its own
        assert "train.checkpoint.dir=checkpoints is relative" in out, out[-3000:]
    step = folders[0] / "checkpoints" / "step_00000004"
    assert not (step / "__2_0.distcp").exists()  # node 0 holds its own ranks' shards only
    (run,) = _runs(uri)
    assert run.info.status == "FINISHED" and "meshflow.end_of_run_errors" not in run.data.tags
    client = MlflowClient(tracking_uri=uri)
    hf_dir = Path(client.download_artifacts(run.info.run_id, "model/hf", str(tmp_path / "download")))
    exported = load_file(client.download_artifacts(run.info.run_id, "model/model.safetensors", str(tmp_path)))

    # the trained model: the checkpoint made whole, as a shared disk would have held it
    # node 1 keeps its shards under the checkpoint's name, unfinished, and nothing half-saved
    node1 = folders[1] / "checkpoints"
    assert sorted(p.name for p in node1.iterdir()) == ["step_00000004"], list(node1.iterdir())
    assert not (node1 / "step_00000004" / "COMPLETE").exists()
    for shard in (node1 / "step_00000004").glob("__*.distcp"):
        shutil.copy(shard, step / shard.name)
    trained, _, _ = load_checkpoint_model(step)
    assert exported.keys() == trained.state_dict().keys()
    assert all(exported[k].equal(v) for k, v in trained.state_dict().items())  # bit for bit
    tokens = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        theirs = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()(tokens).logits
        ours = trained.eval()(tokens)
    diff = float((theirs - ours).abs().max())
    print(f"exported model's logits against the trained model's: max abs diff {diff:.2e}")
    assert diff <= 1e-5


@pytest.mark.slow
def test_a_shared_checkpoint_of_two_nodes_resumes_on_one_node_with_an_uninterrupted_runs_losses(hosts, tmp_path,
                                                                                              compose):
    """Two launchers in their own folders save into one absolute train.checkpoint.dir (a disk both nodes
    mount): fsdp [4] over two nodes for 4 steps; then one launcher resumes from that directory with
    resume=auto on fsdp [2] (another node count and world size) to step 8, and steps 5..8 have the
    losses of one device's uninterrupted 8-step run."""
    from trainer.run.loop import train
    from trainer.run.metrics import NullProgress
    from trainer.tracking.tracker import NullTracker

    # lr warm-up spans steps 1..8 either way: the 4-step run's schedule is the 8-step run's, stopped at 4
    tiny = [*[a for a in COMMON if not a.startswith("train.steps")], "optim.warmup_steps=10"]
    shared = tmp_path / "shared"
    saves = [f"train.checkpoint.dir={shared}", "train.checkpoint.every=2"]
    folders = [tmp_path / "node0", tmp_path / "node1", tmp_path / "alone"]
    for folder in folders:
        folder.mkdir()
    nodes_uri, alone_uri = f"sqlite:///{folders[0]}/mlflow.db", f"sqlite:///{folders[2]}/mlflow.db"
    procs = _start_nodes(hosts, folders[:2], [*TWO_NODES, *tiny, "train.steps=4", *saves,
                                              f"tracking.tracking_uri={nodes_uri}"])
    node0, node1 = _finish(procs, timeout=400)
    assert [p.returncode for p in procs] == [0, 0], (node0[-3000:], node1[-3000:])
    assert "done: steps 1..4" in node0 and "is relative" not in node0 + node1, node0[-3000:]
    assert sorted(p.name for p in shared.iterdir()) == ["step_00000002", "step_00000004"]
    assert sorted(p.name for p in (shared / "step_00000004").glob("*.distcp")) == [f"__{r}_0.distcp" for r in range(4)]

    alone = subprocess.run([sys.executable, "-m", "trainer", "+parallel=fsdp", "mesh=[2]", *tiny, "train.steps=8",
                            *saves, "train.checkpoint.resume=auto", f"tracking.tracking_uri={alone_uri}"],
                           cwd=folders[2], capture_output=True, text=True, timeout=scaled(300))
    assert alone.returncode == 0, alone.stdout[-3000:] + alone.stderr[-3000:]
    assert "done: steps 5..8" in alone.stdout, alone.stdout[-3000:]

    one_device = compose(*tiny, "train.steps=8", "tracking=none", "train.checkpoint.save_final=false")
    want = train(one_device, tracker=NullTracker(), progress=NullProgress()).losses
    got = {**_losses(nodes_uri), **_losses(alone_uri)}  # steps 1..4 on two nodes, 5..8 on one
    assert sorted(_losses(alone_uri)) == [5, 6, 7, 8] and sorted(got) == list(range(1, 9)), got
    assert max(abs(got[s] - want[s - 1]) / abs(want[s - 1]) for s in got) <= 1e-5, (got, want)


@pytest.mark.slow
def test_a_dead_worker_on_node_1_fails_both_nodes_and_is_named(hosts, tmp_path):
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    args = [*TWO_NODES, *[a for a in COMMON if not a.startswith("train.steps")], "train.steps=100000",
            f"tracking.tracking_uri={uri}"]
    procs = _start_nodes(hosts, tmp_path, args)
    pids, seen, deadline = None, [], Deadline(300)
    while pids is None and not deadline.expired():  # node 0 prints every worker's pid, then steps
        line = procs[0].stdout.readline()
        seen.append(line)
        if line.startswith("[node0.0]: workers:"):
            pids = dict(item.split("=") for item in line.split(":", 2)[2].split())
    assert pids, "".join(seen[-50:])
    while "step 2/" not in seen[-1] and not deadline.expired():
        seen.append(procs[0].stdout.readline())
    os.kill(int(pids["rank3"]), signal.SIGKILL)  # rank 3 = node 1's local rank 1
    began = time.monotonic()
    node0, node1 = _finish(procs, timeout=180)
    assert procs[0].returncode == 1 and procs[1].returncode == 1, (node0[-2000:], node1[-2000:])
    assert time.monotonic() - began < scaled(120)  # the failure travels: no timeout had to end it
    host = os.uname().nodename
    assert f"worker rank 3 on node 1 ({host}) (pid {pids['rank3']}) was killed by signal SIGKILL" in node1
    assert "training failed: worker rank" in node0 and "on node 0" in node0, node0[-2000:]
    (run,) = _runs(uri)
    assert run.info.status == "FAILED"


@pytest.mark.slow
def test_a_node_left_alone_says_which_rendezvous_it_waited_for(tmp_path):
    endpoint = f"127.0.0.1:{free_port()}"
    alone = subprocess.run([sys.executable, "-m", "trainer", *TWO_NODES, *COMMON, "tracking=none",
                            "launch.rdzv_timeout_s=3", "launch.rdzv_id=team-run-7", f"launch.rdzv_endpoint={endpoint}"],
                           cwd=tmp_path, capture_output=True, text=True, timeout=scaled(120))
    assert alone.returncode == 1
    assert (f"node 0 of 2: the rendezvous team-run-7 at {endpoint} did not gather all 2 nodes within "
            "launch.rdzv_timeout_s=3 s") in alone.stderr, alone.stderr[-2000:]
