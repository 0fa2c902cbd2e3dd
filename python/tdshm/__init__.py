"""tdshm: a shared-memory process group for torch.distributed (one host, many processes).

Importing this package registers the backend "shm" with torch.distributed::

    import torch.distributed as dist
    import tdshm  # registers "shm"

    dist.init_process_group("shm", init_method="file:///tmp/rendezvous", rank=rank, world_size=2)
    dist.send(torch.arange(4.0), dst=1)            # on rank 0
    sub = dist.new_group([0, 1], backend="shm")    # every rank calls it, as torch requires

Supported: send, recv, isend, irecv (also from any source), broadcast, barrier. Other
collectives (all_reduce, ...) raise RuntimeError. Any init_method torch accepts works
(tcp://, file://, env://); a C++ rank that calls tdshm::init_process_group("shm", ...) with the
same init_method joins the same world.

``tdshm.ProcessGroupShm(name, rank, size, timeout=timedelta(minutes=30))`` makes a group on the
named segment directly, without a store.
"""

import torch  # noqa: F401  (loads libtorch before the extension)
import torch.distributed as _dist

from ._C import ProcessGroupShm, __version__
from . import _C

__all__ = ["ProcessGroupShm", "__version__", "BACKEND"]

#: The name under which the backend is registered with torch.distributed.
BACKEND = "shm"


def _create_shm_backend(store, rank, world_size, timeout):
    """The creator torch.distributed calls: (prefix store, group rank, group size, timedelta)."""
    return _C._create_shm_group(store, rank, world_size, timeout)


# Registered once per interpreter (a reload must not register it twice: torch asserts).
if BACKEND.upper() not in _dist.Backend._plugins:
    _dist.Backend.register_backend(BACKEND, _create_shm_backend)
