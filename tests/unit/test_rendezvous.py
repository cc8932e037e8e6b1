"""The launcher's rendezvous hands the workers the address of a store its rank 0 node already
serves: no window in which another socket on the host can take the port before a worker binds it
(as torch's own port "found free, bound later" has), a fresh store each round, the same address on
every node (on loopback only for a one-host run: tests/api/test_job_isolation.py)."""

from __future__ import annotations

import socket
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

from torch.distributed.elastic.rendezvous import RendezvousParameters, rendezvous_handler_registry

from tests.ports import free_port
from trainer.launch.rendezvous import BACKEND, HOSTS_BACKEND, LOOPBACK, register_rendezvous, worker_store

TIMEOUT = timedelta(seconds=60)


def _handler(loopback: bool, endpoint: str, run_id: str, nodes: int = 1, **configs):
    name = register_rendezvous(loopback)
    assert name == (BACKEND if loopback else HOSTS_BACKEND)
    params = RendezvousParameters(backend=name, endpoint=endpoint, run_id=run_id, min_nodes=nodes, max_nodes=nodes,
                                  local_addr=LOOPBACK, **configs)
    return rendezvous_handler_registry.create_handler(params)


def _listened_on(port: int) -> bool:
    with socket.socket() as probe:
        try:
            probe.bind((LOOPBACK, port))
        except OSError:
            return True
        return False


def _connect(monkeypatch, address: str, port: int):
    monkeypatch.setenv("MASTER_ADDR", address)
    monkeypatch.setenv("MASTER_PORT", str(port))
    return worker_store(TIMEOUT)


def test_each_round_gives_a_store_already_served_on_loopback_and_every_worker_connects(monkeypatch):
    handler = _handler(True, f"{LOOPBACK}:0", "held-store-one-host")
    assert not handler.use_agent_store and handler.get_backend() == BACKEND
    first = handler.next_rendezvous()
    where = first.bootstrap_store_info
    assert (first.rank, first.world_size, where.master_addr) == (0, 1, LOOPBACK)
    assert _listened_on(where.master_port)  # before any worker starts: nothing else can take the port
    rank0, rank1 = (_connect(monkeypatch, LOOPBACK, where.master_port) for _ in range(2))
    rank0.set("hello", "from rank 0")  # rank 0 serves nothing: both reach the launcher's store
    assert rank1.get("hello") == b"from rank 0"
    del rank0, rank1

    second = handler.next_rendezvous()  # a restarted round: a fresh store, the dead round's keys gone
    again = second.bootstrap_store_info.master_port
    assert again != where.master_port and _listened_on(again)
    assert not _connect(monkeypatch, LOOPBACK, again).check(["hello"])
    handler.shutdown()


def test_two_nodes_meet_and_both_get_the_store_rank_0s_node_serves(monkeypatch):
    endpoint = f"{LOOPBACK}:{free_port()}"
    handlers = [_handler(False, endpoint, "held-store-two-hosts", nodes=2, is_host=host, join_timeout=120)
                for host in (True, False)]
    with ThreadPoolExecutor(2) as pool:  # both nodes join at once, as two launchers do
        infos = list(pool.map(lambda h: h.next_rendezvous(), handlers))
    assert sorted(i.rank for i in infos) == [0, 1] and {i.world_size for i in infos} == {2}
    addresses = {(i.bootstrap_store_info.master_addr, i.bootstrap_store_info.master_port) for i in infos}
    assert len(addresses) == 1, addresses  # every node's workers dial the same store
    ((address, port),) = addresses
    assert address == LOOPBACK and _listened_on(port)  # served by rank 0's launcher from the start
    worker_a, worker_b = _connect(monkeypatch, address, port), _connect(monkeypatch, address, port)
    worker_a.set("rank", "0")
    assert worker_b.get("rank") == b"0"
    for handler in handlers:
        handler.shutdown()
