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

Loans (docs/loans.md): ``tdshm.empty(shape, dtype=..., dst=None, group=None)`` and
``tdshm.loan(like, ...)`` give tensors (or dicts of them) whose bytes live in the sender's shared
memory; sending them over "shm" (``dist.send``, ``isend``, tensordict's ``td.send``, a
``Transfer``) posts a reference, and the send completes once the receiver no longer reads them.
``tdshm.recv_view(src, ...)`` and ``Transfer.recv_view(src)`` receive views of them, no copy,
which go back to the sender when dropped or at ``tdshm.release(views)``; an ordinary ``recv``
copies them once. Over other backends a loan is an ordinary tensor. The
heap's size: ``TDSHM_LOAN_BYTES`` (default 1 MiB per rank) and ``TDSHM_LOAN_TICKETS`` (64), the
same on every rank.

``tdshm.Transfer(tree, group=None, init_tag=0, pseudo_rand=False)`` prepares a per-leaf transfer
of a tensordict (or of nested dicts of tensors) once; its ``send``, ``isend``, ``recv`` and
``irecv`` then move every leaf in one call into C++ with the GIL released, on tensordict's wire
(the peer may be a tensordict rank calling ``td.recv``/``td.send``, or a C++ tdshm rank), over
"shm" or any other backend.

``tdshm.DataLoader`` is torch.utils.data.DataLoader (the same arguments and semantics) whose
workers hand batches to the main process through shared memory, zero copy (docs/loader.md).
``tdshm.Board`` is a versioned board: one writer publishes a tree (a dict of tensors, a
TensorDict, a module's state_dict) as versions that readers in other processes copy or view,
newest and never torn (docs/board.md); ``tdshm.BoardRelay`` keeps a copy of it on every other
host of a torch.distributed group (gloo) that spans them.
"""

import torch  # noqa: F401  (loads libtorch before the extension)
import torch.distributed as _dist

from ._C import Board, BoardRelay, ProcessGroupShm, __version__
from . import _C
from .loader import DataLoader

__all__ = ["Board", "BoardRelay", "DataLoader", "ProcessGroupShm", "Transfer", "empty", "loan", "recv_view", "release", "__version__",
           "BACKEND"]

#: The name under which the backend is registered with torch.distributed.
BACKEND = "shm"


def _create_shm_backend(store, rank, world_size, timeout):
    """The creator torch.distributed calls: (prefix store, group rank, group size, timedelta)."""
    return _C._create_shm_group(store, rank, world_size, timeout)


# Registered once per interpreter (a reload must not register it twice: torch asserts).
if BACKEND.upper() not in _dist.Backend._plugins:
    _dist.Backend.register_backend(BACKEND, _create_shm_backend)


def Transfer(tree, group=None, *, init_tag=0, pseudo_rand=False):
    """A per-leaf transfer of ``tree`` prepared once, for loops that move the same tree again.

    ``tree``: a tensordict ``TensorDict`` or a dict of tensors and nested dicts (str keys; any
    other value in a dict is a TypeError; a tensordict's non-tensor values send nothing, as in
    tensordict). The leaves go in tensordict's per-leaf order (sorted keys at every level, depth
    first) with tensordict's tags (``init_tag``, ``init_tag + 1``, ... or, with ``pseudo_rand``,
    tensordict's pseudo-random sequence), so the other side may be tensordict's own
    ``td.recv(src, init_tag=..., pseudo_rand=...)`` (or ``td.send``), another ``Transfer`` or a C++
    rank. ``group``: a torch.distributed group (default: the default group).

    Methods, with tensordict's meaning and results (peers: exactly one of ``dst``/``group_dst``,
    ``src``/``group_src``; the ``dst``/``src`` ranks are global ranks, as in torch.distributed):

    * ``send(dst=None, group_dst=None)``; ``isend(dst=None, group_dst=None, return_early=False)``
      returns the last tag, or the list of Works with ``return_early``;
    * ``recv(src=None, group_src=None)`` receives into the tree's own tensors in place and returns
      the last tag; ``irecv(src=None, group_src=None, return_premature=False)`` returns None or,
      with ``return_premature``, the list of Works;
    * ``keys()``: the leaves' key paths in transfer order; ``tags()``: their tags.

    Each call first checks, by identity, that the tree still holds what was prepared (~20 ns a
    key): a leaf replaced by another tensor, or a key added or removed, is noticed and the tree is
    walked again, so a call always moves the tree as it is. Tensors changed in place need nothing.
    Errors: TypeError (a bad tree, a tensor that cannot take bytes in place), KeyError,
    TimeoutError, and RuntimeError for the others (transport, shape or schema mismatches).
    """
    if group is None:
        group = _dist.distributed_c10d._get_default_group()
    ranks = _dist.distributed_c10d.get_process_group_ranks(group)
    return _C._Transfer(tree, group, list(ranks), int(init_tag), bool(pseudo_rand))


def _shm_backend(group):
    """The ProcessGroupShm behind ``group`` (default: the default group), or None."""
    if group is None:
        group = _dist.distributed_c10d._get_default_group()
    return group if isinstance(group, ProcessGroupShm) else None


def empty(shape, *, dtype=torch.float32, dst=None, group=None):
    """A tensor of ``shape`` and ``dtype`` (contents undefined, as ``torch.empty``) whose bytes
    live in this rank's loan heap of ``group``'s shared memory (default: the default group):
    sending it, or a contiguous part of it, to any rank of the group posts a reference, and the
    send completes once the receiver no longer reads the bytes (it copied them, or dropped its
    view). Reuse it once that send completed (double-buffer with two). ``dst`` names the rank it
    is meant for; any rank of the group may receive it. Raises TimeoutError while receivers hold
    the whole heap past the group's timeout. Over a backend without loans: ``torch.empty``."""
    pg = _shm_backend(group)
    if pg is None:
        return torch.empty(tuple(shape), dtype=dtype)
    return pg.loan([int(d) for d in shape], dtype)


def loan(like, *, dst=None, group=None):
    """``tdshm.empty`` shaped like ``like``: a tensor, or a dict / tensordict of them (the same
    keys, nested; a tensordict's ``apply`` keeps its batch size and non-tensor values)."""
    if isinstance(like, torch.Tensor):
        return empty(like.shape, dtype=like.dtype, dst=dst, group=group)
    if isinstance(like, dict):
        return {k: loan(v, dst=dst, group=group) for k, v in like.items()}
    if hasattr(like, "apply"):
        return like.apply(lambda t: empty(t.shape, dtype=t.dtype, dst=dst, group=group))
    raise TypeError("tdshm.loan: like is a tensor, a dict of tensors or a tensordict; got " + type(like).__name__)


def recv_view(src, *, tag=0, group=None, like=None):
    """Receives the tensor global rank ``src`` sends with ``tag`` over ``group`` (default: the
    default group) in the sender's shape and dtype: over "shm" a view of the sender's loan (no
    copy; the bytes go back when the view is dropped), or a fresh tensor for an ordinary message.
    Over another backend the shape is not on the wire: ``like`` (a tensor) gives it and the
    message is received into ``torch.empty_like(like)``."""
    pg = _shm_backend(group)
    if pg is None:
        if like is None:
            raise TypeError("tdshm.recv_view: this group's backend sends no shapes; pass like=")
        out = torch.empty_like(like)
        _dist.recv(out, src=src, tag=tag, group=group)
        return out
    g = group if group is not None else _dist.distributed_c10d._get_default_group()
    group_src = _dist.distributed_c10d.get_group_rank(g, src) if group is not None else src
    return pg.recv_view(group_src, tag)


def release(views):
    """Gives the bytes of received views (``recv_view``, ``Transfer.recv_view``) back to their
    senders now rather than when the views are garbage-collected: a tensor, or a dict / tensordict
    of them. The views must not be read afterwards (the sender may write into the bytes). Returns
    how many loans went back (0 for tensors that are not views of a loan, or were released)."""
    if isinstance(views, torch.Tensor):
        return 1 if _C._release_view(views) else 0
    if isinstance(views, dict):
        return sum(release(v) for v in views.values())
    if hasattr(views, "values"):
        return sum(release(v) for v in views.values())
    raise TypeError("tdshm.release: a tensor, a dict of tensors or a tensordict; got " + type(views).__name__)
