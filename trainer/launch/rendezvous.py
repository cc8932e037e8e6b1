"""Where a run's stores listen, and who serves the workers' process-group store.

The launcher serves the workers' store itself, in the rendezvous handler of the node that the
rendezvous made rank 0, a fresh one each round (:class:`WorkerStoreServer`): every worker connects
to it (:func:`worker_store`). torch's own way, a port found free by the agent and bound by torch rank
0 seconds later, can lose the port in between to any other socket on the host (CI saw it happen).

torch's ``TCPStore`` server binds every interface (``[::]``) whatever host it is given, so a
run on one host would accept connections from the network on three ports: the elastic agent's
c10d rendezvous store, the workers' store and gloo's pairs. When ``launch.nnodes`` is
1 and ``launch.rdzv_endpoint`` is a loopback address (the default, and all the service
allows), the launcher instead

- registers the ``meshflow-loopback`` rendezvous backend: torch's c10d backend over a store
  whose socket this module bound to 127.0.0.1 (``TCPStore(master_listen_fd=...)``);
- serves the workers' store bound the same way and gives them ``MASTER_ADDR=127.0.0.1``;
- sets ``GLOO_SOCKET_IFNAME=lo`` unless the user chose an interface.

Other runs (``meshflow-c10d``) keep torch's c10d rendezvous; their stores must be reachable from the
other hosts.
"""

from __future__ import annotations

import json
import os
import socket
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from trainer.config.schema import RunConfig

LOOPBACK = "127.0.0.1"
LOOPBACK_HOSTS = frozenset({"127.0.0.1", "localhost", "::1", "[::1]"})
BACKEND = "meshflow-loopback"
HOSTS_BACKEND = "meshflow-c10d"
WORKER_STORE_KEY = "meshflow/worker_store"  # in the round's store: [address, port] of the workers' store
WORKER_STORE_TIMEOUT = timedelta(minutes=10)  # as the workers' process group's own


def is_loopback_run(cfg: RunConfig) -> bool:
    """One host, and a rendezvous endpoint on loopback: nothing needs to listen anywhere else."""
    host = cfg.launch.rdzv_endpoint.rsplit(":", 1)[0]
    return cfg.launch.nnodes == 1 and host in LOOPBACK_HOSTS


def loopback_store(port: int, *, timeout: timedelta, multi_tenant: bool = True):
    """A ``TCPStore`` server listening on 127.0.0.1:``port`` (0: a free port) only."""
    import torch.distributed as dist

    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind((LOOPBACK, port))
    listener.listen(512)
    bound = listener.getsockname()[1]
    return dist.TCPStore(LOOPBACK, bound, is_master=True, wait_for_workers=False, timeout=timeout,
                         multi_tenant=multi_tenant, master_listen_fd=listener.detach())  # the store owns the fd


class WorkerStoreServer:
    """torch's dynamic rendezvous handler, whose rounds give the workers the address of a store the
    round's rank 0 node serves in this process (``serve()``: a fresh one per round, since a restarted
    round's process groups must not read the dead round's addresses), published to the other nodes in
    the round's store, rather than a port found free for torch rank 0 to bind later."""

    def __init__(self, inner, serve: Callable[[], Any], address: str) -> None:
        self._inner, self._serve, self._address, self._served = inner, serve, address, None

    def next_rendezvous(self):
        from torch.distributed.elastic.rendezvous.api import RendezvousInfo, RendezvousStoreInfo

        info = self._inner.next_rendezvous()
        if info.rank == 0:
            self._served = self._serve()  # the last round's store closes here
            info.store.set(WORKER_STORE_KEY, json.dumps([self._address, self._served.port]))
        else:
            self._served = None
        address, port = json.loads(info.store.get(WORKER_STORE_KEY))  # waits for node 0's, as the join does
        return RendezvousInfo(info.store, info.rank, info.world_size, RendezvousStoreInfo(address, port))

    # The rest of torch's RendezvousHandler, as the dynamic handler does it.
    def get_backend(self) -> str:
        return self._inner.get_backend()

    @property
    def use_agent_store(self) -> bool:
        return False  # the workers' store is neither the rendezvous store nor the agent's

    def is_closed(self) -> bool:
        return self._inner.is_closed()

    def set_closed(self) -> None:
        self._inner.set_closed()

    def num_nodes_waiting(self) -> int:
        return self._inner.num_nodes_waiting()

    def get_run_id(self) -> str:
        return self._inner.get_run_id()

    def shutdown(self) -> bool:
        return self._inner.shutdown()


def _dynamic_handler(name: str, store, params):
    """torch's dynamic rendezvous over its c10d backend on ``store``, under the name the launcher asked for
    (torch's registry checks a handler's backend answers to it)."""
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler

    class NamedBackend(C10dRendezvousBackend):
        @property
        def name(self) -> str:
            return name

    return create_handler(store, NamedBackend(store, params.run_id), params)


def _create_handler(params):
    """``meshflow-loopback``: the rendezvous store and the workers' on 127.0.0.1."""
    port = int(params.endpoint.rsplit(":", 1)[1]) if ":" in params.endpoint else 0
    store = loopback_store(port, timeout=timedelta(seconds=params.get_as_int("read_timeout", 60)))
    inner = _dynamic_handler(BACKEND, store, params)
    return WorkerStoreServer(inner, lambda: loopback_store(0, timeout=WORKER_STORE_TIMEOUT), LOOPBACK)


def _create_hosts_handler(params):
    """``meshflow-c10d``: torch's c10d rendezvous (its store where torch puts it, on node 0 for
    ``is_host``); the workers' store served by rank 0's node on every interface, at its
    ``launch.local_addr`` (else its name), as torch rank 0 would have served it."""
    import torch.distributed as dist
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import create_backend

    _, store = create_backend(params)
    address = params.local_addr or socket.getfqdn()  # what torch's rendezvous names this node by

    def serve():
        return dist.TCPStore(address, 0, is_master=True, wait_for_workers=False, timeout=WORKER_STORE_TIMEOUT,
                             multi_tenant=True)

    return WorkerStoreServer(_dynamic_handler(HOSTS_BACKEND, store, params), serve, address)


def register_rendezvous(loopback: bool) -> str:
    """The rendezvous backend for a run (``meshflow-loopback`` on one host's loopback, else
    ``meshflow-c10d``), made known to torch's elastic launcher (once per process): its name."""
    from torch.distributed.elastic.rendezvous import rendezvous_handler_registry

    name, creator = (BACKEND, _create_handler) if loopback else (HOSTS_BACKEND, _create_hosts_handler)
    rendezvous_handler_registry.register(name, creator)  # again with the same creator: a no-op
    # torch's handler would otherwise serve a store of its own for the workers (on every interface, and shared
    # by the rounds: a restarted round's sub-groups read the dead round's addresses, gloo's "connectFullMesh ...
    # Connection refused"); :class:`WorkerStoreServer` serves theirs, a fresh one per round
    os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    if loopback:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # the spawned workers inherit it
    return name


def worker_store(timeout: timedelta):
    """A worker's process-group store: the one its launcher's rendezvous serves (:class:`WorkerStoreServer`),
    at the address and port the elastic agent gave (``MASTER_ADDR/PORT``); every worker connects. The
    launcher builds the store (rather than ``env://``) to serve it so, and to number the ranks in node order
    on several hosts."""
    import torch.distributed as dist

    return dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=timeout)
