"""One-host runs listen on loopback only: the rendezvous store, the workers' store and gloo.

torch's ``TCPStore`` server binds every interface (``[::]``) whatever host it is given, so a
run on one host would accept connections from the network on three ports: the elastic agent's
c10d rendezvous store, rank 0's process-group store and gloo's pairs. When ``launch.nnodes`` is
1 and ``launch.rdzv_endpoint`` is a loopback address (the default, and all the service
allows), the launcher instead

- registers the ``meshflow-loopback`` rendezvous backend: torch's c10d backend over a store
  whose socket this module bound to 127.0.0.1 (``TCPStore(master_listen_fd=...)``);
- gives the workers ``MASTER_ADDR=127.0.0.1`` (``LaunchConfig.local_addr``), and rank 0 builds
  its process-group store the same way (:func:`worker_store`);
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
    return create_handler(store, LoopbackBackend(store, params.run_id), params)


def register_loopback_rendezvous() -> None:
    """Make ``rdzv_backend="meshflow-loopback"`` known to torch's elastic launcher (once per process)."""
    from torch.distributed.elastic.rendezvous import rendezvous_handler_registry

    rendezvous_handler_registry.register(BACKEND, _create_handler)  # again with the same creator: a no-op
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # the spawned workers inherit it


def worker_store(serves: bool, timeout: timedelta, *, loopback: bool):
    """A worker's process-group store, at the address and port the elastic agent gave
    (``MASTER_ADDR/PORT``): the worker that ``serves`` (torch's rank 0) listens there, on loopback
    only for a loopback run, the others connect. The launcher builds the store itself (rather
    than ``env://``) to listen on loopback, and to number the ranks in node order on several hosts."""
    import torch.distributed as dist

    port = int(os.environ["MASTER_PORT"])
    if serves and loopback:
        return loopback_store(port, timeout=timeout)
    return dist.TCPStore(os.environ.get("MASTER_ADDR", LOOPBACK), port, is_master=serves, wait_for_workers=False,
                         timeout=timeout, multi_tenant=True)
