"""A one-host run's rendezvous hands the workers the port of a store the launcher already serves:
no window in which another socket on the host can take the port before rank 0 binds it (as torch's
own port "found free, bound later" has), a fresh store each round (on loopback only:
tests/api/test_job_isolation.py)."""

from __future__ import annotations

import socket
from datetime import timedelta

from torch.distributed.elastic.rendezvous import RendezvousParameters, rendezvous_handler_registry

from trainer.launch.rendezvous import BACKEND, LOOPBACK, register_loopback_rendezvous, worker_store


def _handler():
    register_loopback_rendezvous()
    params = RendezvousParameters(backend=BACKEND, endpoint=f"{LOOPBACK}:0", run_id="held-store-test",
                                  min_nodes=1, max_nodes=1, local_addr=LOOPBACK)
    return rendezvous_handler_registry.create_handler(params)


def _port_taken(port: int) -> bool:
    with socket.socket() as probe:
        try:
            probe.bind((LOOPBACK, port))
        except OSError:
            return True
        return False


def test_each_round_gives_a_store_already_served_on_loopback_and_every_worker_connects(monkeypatch):
    handler = _handler()
    assert not handler.use_agent_store and handler.get_backend() == BACKEND
    first = handler.next_rendezvous()
    port = first.bootstrap_store_info.master_port
    assert (first.rank, first.world_size, first.bootstrap_store_info.master_addr) == (0, 1, LOOPBACK)
    assert _port_taken(port)  # listened on before any worker starts: nothing else can take it
    # Every worker connects, rank 0 too (it serves nothing): the launcher's store carries their keys.
    monkeypatch.setenv("MASTER_PORT", str(port))
    rank0, rank1 = (worker_store(serves, timedelta(seconds=30), loopback=True) for serves in (True, False))
    rank0.set("hello", "from rank 0")
    assert rank1.get("hello") == b"from rank 0"
    del rank0, rank1

    second = handler.next_rendezvous()  # a restarted round: a fresh store, the dead round's keys gone
    again = second.bootstrap_store_info.master_port
    assert again != port and _port_taken(again)
    monkeypatch.setenv("MASTER_PORT", str(again))
    fresh = worker_store(True, timedelta(seconds=30), loopback=True)
    assert not fresh.check(["hello"])
    handler.shutdown()

