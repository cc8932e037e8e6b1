"""One-host runs listen on loopback only: the rendezvous store, the workers' store and gloo.

torch's ``TCPStore`` server binds every interface (``[::]``) whatever host it is given, so a
run on one host would accept connections from the network on three ports: the elastic agent's
c10d rendezvous store, rank 0's process-group store and gloo's pairs. When ``launch.nnodes`` is
1 and ``launch.rdzv_endpoint`` is a loopback address (the default, and all the service
allows), the launcher instead

- registers the ``meshflow-loopback`` rendezvous backend: torch's c10d backend over a store
  whose socket this module bound to 127.0.0.1 (``TCPStore(master_listen_fd=...)``);
- serves the workers' process-group store itself, bound the same way, a fresh one for each round of
  the rendezvous (:class:`HeldWorkerStore`), and gives them ``MASTER_ADDR=127.0.0.1`` and its port:
  every worker connects (:func:`worker_store`). torch's own way, a port found free by the agent and
  bound by rank 0 seconds later, can lose the port in between to any other socket on the host;
- sets ``GLOO_SOCKET_IFNAME=lo`` unless the user chose an interface.

Several hosts keep torch's own behaviour: their stores must be reachable from the other hosts.
"""

from __future__ import annotations

import os
import socket
from datetime import timedelta

from trainer.config.schema import RunConfig

LOOPBACK = "127.0.0.1"
LOOPBACK_HOSTS = frozenset({"127.0.0.1", "localhost", "::1", "[::1]"})
BACKEND = "meshflow-loopback"
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


class HeldWorkerStore:
    """torch's dynamic rendezvous handler, whose rounds give the workers the port of a store this
    process serves on loopback (a fresh one per round: a restarted round's process groups must not
    read the dead round's addresses), rather than a port found free for rank 0 to bind later."""

    def __init__(self, inner, timeout: timedelta) -> None:
        self._inner, self._timeout, self._served = inner, timeout, None

    def next_rendezvous(self):
        from torch.distributed.elastic.rendezvous.api import RendezvousInfo, RendezvousStoreInfo

        info = self._inner.next_rendezvous()
        self._served = loopback_store(0, timeout=self._timeout)  # the last round's store closes here
        return RendezvousInfo(info.store, info.rank, info.world_size, RendezvousStoreInfo(LOOPBACK, self._served.port))

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


def _create_handler(params):
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler

    class LoopbackBackend(C10dRendezvousBackend):
        """torch's c10d rendezvous backend, under the name the launcher asked for."""

        @property
        def name(self) -> str:
            return BACKEND

    port = int(params.endpoint.rsplit(":", 1)[1]) if ":" in params.endpoint else 0
    store = loopback_store(port, timeout=timedelta(seconds=params.get_as_int("read_timeout", 60)))
    return HeldWorkerStore(create_handler(store, LoopbackBackend(store, params.run_id), params), WORKER_STORE_TIMEOUT)


def register_loopback_rendezvous() -> None:
    """Make ``rdzv_backend="meshflow-loopback"`` known to torch's elastic launcher (once per process)."""
    from torch.distributed.elastic.rendezvous import rendezvous_handler_registry

    rendezvous_handler_registry.register(BACKEND, _create_handler)  # again with the same creator: a no-op
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # the spawned workers inherit it


def worker_store(serves: bool, timeout: timedelta, *, loopback: bool):
    """A worker's process-group store, at the address and port the elastic agent gave
    (``MASTER_ADDR/PORT``). A loopback run's every worker connects to the store the launcher serves
    (:class:`HeldWorkerStore`); on several hosts the worker that ``serves`` (torch's rank 0) listens
    there and the others connect. The launcher builds the store itself (rather than ``env://``) to
    listen on loopback, and to number the ranks in node order on several hosts."""
    import torch.distributed as dist

    port = int(os.environ["MASTER_PORT"])
    if loopback:
        return dist.TCPStore(LOOPBACK, port, is_master=False, timeout=timeout)
    return dist.TCPStore(os.environ.get("MASTER_ADDR", LOOPBACK), port, is_master=serves, wait_for_workers=False,
                         timeout=timeout, multi_tenant=True)
