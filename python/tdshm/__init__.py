"""tdshm: a shared-memory process group for torch.distributed (one host, many processes).

Importing this package registers the backend "shm" with torch.distributed::

    import torch.distributed as dist
    import tdshm  # registers "shm"

    dist.init_process_group("shm", init_method="file:///tmp/rendezvous", rank=rank, world_size=2)
    dist.send(torch.arange(4.0), dst=1)            # on rank 0
    sub = dist.new_group([0, 1], backend="shm")    # every rank calls it, as torch requires

Supported, on CPU tensors of any dtype and any strides:

* point to point: send, recv, isend, irecv (also from any source, src=None);
* the collectives broadcast, barrier, all_reduce, all_reduce_coalesced, reduce, all_gather,
  all_gather_into_tensor, gather, scatter, reduce_scatter, reduce_scatter_tensor and
  all_to_all_single (c10d's broadcast, barrier, allreduce, allreduce_coalesced, reduce,
  allgather, _allgather_base, gather, scatter, reduce_scatter, _reduce_scatter_base and
  alltoall_base), and so all_gather_object, gather_object, broadcast_object_list and
  scatter_object_list, which torch builds on them. Reduce ops: SUM, AVG (floating point and
  complex), PRODUCT, MIN, MAX (not complex), BAND, BOR, BXOR (integers and bool).

These raise RuntimeError naming the operation: all_to_all (lists of tensors),
all_gather_coalesced and monitored_barrier, a reduce op the dtype does not have (BAND on a
float tensor, say) and PREMUL_SUM. Errors of the transport (a peer gone, a timeout, a size
mismatch) are RuntimeErrors too, raised by the call or by Work.wait().

Any init_method torch accepts works (tcp://, file://, env://); a C++ rank that calls
tdshm::init_process_group("shm", ...) with the same init_method joins the same world.

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
