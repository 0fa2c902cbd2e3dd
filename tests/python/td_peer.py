#!/usr/bin/env python3
"""A faithful, self-contained Python peer of tensordict 0.14's distributed protocol.

tensordict itself cannot be installed here, so this file re-implements, with plain
``torch.distributed`` calls, exactly the messages tensordict 0.14 (docs/wire.md)
sends and expects. The interop tests (tests/interop/test_interop.cpp) run it as one or more
ranks of a world whose other ranks are tdshm (C++) processes. What it follows, function by
function of tensordict's source:

* per-leaf ``send`` / ``isend`` / ``recv`` / ``irecv`` (``TensorDictBase._send``, ``_isend``,
  ``_recv``, ``_irecv``): one message per tensor leaf, keys sorted at every level
  (``sorted(self.keys())``), depth first into nested tensordicts; non-tensor values send nothing.
  Tags: ``_tag = init_tag - 1``, then per leaf ``_tag += 1`` or, with ``pseudo_rand``,
  ``_tag = int_generator(_tag + 1)`` (``tensordict/utils.py``: numpy ``default_rng(seed)``,
  ``.bytes(8)`` read big-endian, ``% 10_000``). With ``group_dst`` / ``group_src`` the call is
  ``group.send([t], group_dst, tag)`` / ``group.recv([t], group_src, tag)``, else
  ``dist.isend / irecv / send / recv(t, dst|src, tag=tag, group=group)``. Peer arguments are
  checked as ``_check_p2p_peer`` does.
* ``consolidate(metadata=True)`` (``TensorDictBase.consolidate`` and
  ``_reduce_vals_and_metadata``): leaves in insertion order, depth first; ``consolidate`` calls
  ``_reduce_vals_and_metadata(..., dtype=None)``, so ``need_padding`` is always true (the packed
  branch, ``pad = 0``, is only taken by pickling a single-dtype tree): each leaf is zero-padded
  to a multiple of 8 bytes (``pad = 8 - n % 8`` when non-zero). The leaf
  metadata is the tuple ``(str(dtype), list(shape), start, stop, pad)`` where ``stop - start``
  is the leaf's bytes *plus* its pad. A node's metadata is ``{"cls": "TensorDict",
  "non_tensors": {key: (data, list(batch_size), device str or None)}, "leaves": {...},
  "cls_metadata": {"device", "names", "batch_size", "is_locked"}}`` followed by one entry per
  child node (its own key), in insertion order. ``names`` is what ``TensorDict.names`` returns:
  ``[None] * batch_dims`` when the tensordict has no names.
* ``send/recv(consolidated=True)``: the storage alone, one uint8 message, tag 0.
* ``init_remote`` (p2p): consolidate(metadata=True), ``metadata["_total_bytes"]``, optional
  ``metadata["_tensorclass_type"]``, ``send_object_list([metadata], dst)`` then
  ``send(storage, dst)``. ``from_remote_init`` mirrors with ``recv_object_list`` and ``recv``
  into ``torch.empty(_total_bytes, uint8)``, then ``_rebuild_tensordict_files_consolidated``
  (``tensordict/_reductions.py``): non-tensors first, then leaves
  (``storage[start:stop].view(dtype)[:numel if pad].view(shape)``), then children.
* ``broadcast`` (and ``init_remote(use_broadcast=True)``): metadata gets ``_total_bytes``, then
  ``_storage_device`` (then ``_tensorclass_type``), ``broadcast_object_list([metadata], src)``,
  ``broadcast(storage, src)``.
* ``reduce`` (``TensorDictBase.reduce`` / ``_reduce``): one ``dist.reduce(leaf, dst, op, async_op,
  group)`` per tensor leaf over ``sorted_keys``, depth first; the recursion into a nested
  tensordict does not pass ``group`` on (kept here as tensordict has it). Returns the works
  only with ``async_op`` and ``return_premature``; ``async_op`` alone waits for them.
* ``all_reduce``: one ``dist.all_reduce(leaf, op, group, async_op)`` per leaf in ``_fast_apply``
  order (insertion order, depth first); returns the works with ``async_op``.
* ``all_gather``: consolidate(metadata=True), ``metadata["_total_bytes"]``,
  ``all_gather_object`` of the metadata (torch 1.13's: an all_gather of the int64 pickle lengths,
  then of the pickles padded to the longest), then ``dist.all_gather`` of the storages
  zero-padded to the largest; one rebuilt tensordict per rank.
* ``scatter``: the source consolidates each tensordict, adds ``_total_bytes``, ``_max_bytes``,
  ``_storage_device`` to its metadata, ``scatter_object_list`` (torch 1.13's: broadcast of the
  longest pickle's length, scatter of the padded pickles, scatter of their lengths), then
  ``dist.scatter`` of the storages zero-padded to ``_max_bytes``.
* torch 1.13 has no ``send_object_list`` / ``recv_object_list``: they are written here as torch
  writes them later (``_object_to_tensor``: ``pickle.Pickler(f).dump(obj)``, default protocol):
  an int64 tensor of the pickles' byte lengths, then one uint8 tensor of the pickles back to back,
  both with tag 0. ``broadcast_object_list`` is the same two tensors broadcast (as torch 1.13
  does; ``--torch-object-list`` uses torch's own function instead, to check that they agree).

Received metadata is unpickled by an unpickler that refuses every global (tensordict's metadata
holds plain types only), so a sender that pickles anything else is caught.

Values are deterministic patterns of (key, dtype, shape, salt) (``pattern``), computed
identically by the C++ side, so each side checks what it received without a second channel.

Usage (one rank):
  td_peer.py --rank R --world W --init-method file://PATH --backend gloo|shm \
             --scenario perleaf|consolidated|remote|broadcast|all_reduce|reduce|all_gather|scatter|idle
             --role send|recv|root|member ...
  td_peer.py --dump-consolidated TREE[,TREE...]   (storage bytes and leaf offsets, for layout tests)
Prints one JSON line {"ok": ...}; exits 0 on success, 1 on any mismatch or error, 3 when the
environment lacks something (e.g. the tdshm package for --backend shm).
"""

import argparse
import datetime
import importlib
import io
import json
import os
import pickle
import sys
import traceback

sys.dont_write_bytecode = True  # td_peer_types is imported from the source tree

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

# ------------------------------------------------------------------------------------------
# The model: a nested tree of tensors, child trees and non-tensor values


class NonTensor:
    """A non-tensor value (tensordict's NonTensorData): data, batch size, device."""

    def __init__(self, data, batch_size, device):
        self.data = data
        self.batch_size = list(batch_size)
        self.device = device


class TD:
    """A tensordict: insertion-ordered key -> torch.Tensor | TD | NonTensor."""

    def __init__(self, batch_size=(), device=None, names=None):
        self.items = {}
        self.batch_size = list(batch_size)
        self.device = device  # str or None
        self._names = names
        self.is_locked = False
        self.consolidated = None  # {"storage": uint8 tensor, "metadata": dict}

    @property
    def names(self):
        # TensorDict.names: [None] * batch_dims when no names were given.
        if self._names is None:
            return [None for _ in range(len(self.batch_size))]
        return list(self._names)

    def set(self, key, value):
        key = (key,) if isinstance(key, str) else tuple(key)
        node = self
        for part in key[:-1]:
            if part not in node.items:
                node.items[part] = TD(node.batch_size, node.device)
            node = node.items[part]
            if not isinstance(node, TD):
                raise KeyError(f"{key}: {part} is not a tensordict")
        if isinstance(value, (torch.Tensor, TD, LazyStack)):
            node.items[key[-1]] = value
        else:
            node.items[key[-1]] = NonTensor(value, node.batch_size, node.device)
        return self

    def get(self, key):
        key = (key,) if isinstance(key, str) else tuple(key)
        node = self
        for part in key:
            node = node.items[part]
        return node

    def sorted_keys(self):
        return sorted(self.items.keys())

    def leaves_in_order(self, prefix=()):
        """(path, tensor) in insertion order, depth first (consolidation order)."""
        for k, v in self.items.items():
            if isinstance(v, torch.Tensor):
                yield prefix + (k,), v
            elif isinstance(v, TD):
                yield from v.leaves_in_order(prefix + (k,))

    def leaves_sorted(self, prefix=()):
        """(path, tensor) in per-leaf transfer order: sorted keys, depth first."""
        for k in self.sorted_keys():
            v = self.items[k]
            if isinstance(v, torch.Tensor):
                yield prefix + (k,), v
            elif isinstance(v, TD):
                yield from v.leaves_sorted(prefix + (k,))
            # NonTensor: tensordict recurses into the NonTensorData's empty tensordict: nothing.

    def non_tensors(self, prefix=()):
        for k, v in self.items.items():
            if isinstance(v, NonTensor):
                yield prefix + (k,), v
            elif isinstance(v, TD):
                yield from v.non_tensors(prefix + (k,))

    def dtype(self):
        """TensorDictBase._dtype: the leaves' dtype if it is unique, else None."""
        dtype = None
        for _, t in self.leaves_in_order():
            if dtype is None:
                dtype = t.dtype
            elif dtype != t.dtype:
                return None
        return dtype


# ------------------------------------------------------------------------------------------
# Tags


class LazyStack:
    """tensordict's LazyStackedTensorDict as its transfers see it (_lazy.py, v0.14): the members,
    in order; each sends its leaves as a TensorDict does, the tag running on."""

    def __init__(self, tensordicts, stack_dim=0):
        self.tensordicts = list(tensordicts)
        self.stack_dim = stack_dim
        self.consolidated = None  # {"storage": uint8 tensor, "metadata": dict}


def int_generator(seed):
    """tensordict.utils.int_generator."""
    max_seed_val = 10_000
    rng = np.random.default_rng(seed)
    seed = int.from_bytes(rng.bytes(8), "big")
    return seed % max_seed_val


def _next_tag(tag, pseudo_rand):
    return int_generator(tag + 1) if pseudo_rand else tag + 1


def _check_p2p_peer(peer, group_peer, group, peer_name, group_peer_name):
    if group_peer is not None:
        if group is None:
            raise ValueError(f"`{group_peer_name}` requires `group` to be passed.")
        if peer is not None:
            raise ValueError(f"`{peer_name}` and `{group_peer_name}` are mutually exclusive.")
    elif peer is None:
        raise ValueError(f"Exactly one of `{peer_name}` and `{group_peer_name}` must be provided.")


# ------------------------------------------------------------------------------------------
# Per-leaf transfers (TensorDictBase.send/_send, isend/_isend, recv/_recv, irecv/_irecv)


def _send(td, dst, _tag, pseudo_rand, group, group_dst):
    if isinstance(td, LazyStack):  # _lazy.py: member after member, the tag running on
        for member in td.tensordicts:
            _tag = _send(member, dst, _tag, pseudo_rand, group, group_dst)
        return _tag
    for key in td.sorted_keys():
        value = td.items[key]
        if isinstance(value, (TD, LazyStack)):
            _tag = _send(value, dst, _tag, pseudo_rand, group, group_dst)
            continue
        if not isinstance(value, torch.Tensor):
            continue
        _tag = _next_tag(_tag, pseudo_rand)
        if group_dst is not None:
            group.send([value], group_dst, _tag).wait()
        else:
            dist.send(value, dst=dst, tag=_tag, group=group)
    return _tag


def send(td, dst=None, *, group=None, group_dst=None, init_tag=0, pseudo_rand=False, consolidated=False):
    _check_p2p_peer(dst, group_dst, group, "dst", "group_dst")
    if consolidated:
        td_c = td if td.consolidated is not None else consolidate(td)
        storage = td_c.consolidated["storage"]
        if group_dst is not None:
            group.send([storage], group_dst, 0).wait()
        else:
            dist.send(storage, dst=dst, group=group)
        return None
    _send(td, dst, init_tag - 1, pseudo_rand, group, group_dst)
    return None


def _isend(td, dst, _tag, _futures, pseudo_rand, group, group_dst):
    if isinstance(td, LazyStack):  # _lazy.py: member after member, the tag running on
        for member in td.tensordicts:
            _tag = _isend(member, dst, _tag, _futures, pseudo_rand, group, group_dst)
        return _tag
    for key in td.sorted_keys():
        value = td.items[key]
        if isinstance(value, (TD, LazyStack)):
            _tag = _isend(value, dst, _tag, _futures, pseudo_rand, group, group_dst)
            continue
        if not isinstance(value, torch.Tensor):
            continue
        _tag = _next_tag(_tag, pseudo_rand)
        if group_dst is not None:
            _futures.append(group.send([value], group_dst, _tag))
        else:
            _futures.append(dist.isend(value, dst=dst, tag=_tag, group=group))
    return _tag


def isend(td, dst=None, *, group=None, group_dst=None, init_tag=0, pseudo_rand=False, return_early=False):
    _check_p2p_peer(dst, group_dst, group, "dst", "group_dst")
    futures = []
    tag = _isend(td, dst, init_tag - 1, futures, pseudo_rand, group, group_dst)
    if return_early:
        return futures
    for f in futures:
        f.wait()
    return tag


def _recv(td, src, _tag, pseudo_rand, group, group_src):
    if isinstance(td, LazyStack):  # _lazy.py: member after member, the tag running on
        for member in td.tensordicts:
            _tag = _recv(member, src, _tag, pseudo_rand, group, group_src)
        return _tag
    for key in td.sorted_keys():
        value = td.items[key]
        if isinstance(value, (TD, LazyStack)):
            _tag = _recv(value, src, _tag, pseudo_rand, group, group_src)
            continue
        if not isinstance(value, torch.Tensor):
            continue
        _tag = _next_tag(_tag, pseudo_rand)
        if group_src is not None:
            group.recv([value], group_src, _tag).wait()
        else:
            dist.recv(value, src=src, tag=_tag, group=group)
    return _tag


def recv(td, src=None, *, group=None, group_src=None, init_tag=0, pseudo_rand=False, consolidated=False):
    _check_p2p_peer(src, group_src, group, "src", "group_src")
    if consolidated:
        storage = td.consolidated["storage"]
        if group_src is not None:
            group.recv([storage], group_src, 0).wait()
        else:
            dist.recv(storage, src=src, group=group)
        return None
    return _recv(td, src, init_tag - 1, pseudo_rand, group, group_src)


def _irecv(td, src, _tag, _futures, pseudo_rand, group, group_src):
    if isinstance(td, LazyStack):  # _lazy.py: member after member, the tag running on
        for member in td.tensordicts:
            _tag = _irecv(member, src, _tag, _futures, pseudo_rand, group, group_src)
        return _tag
    for key in td.sorted_keys():
        value = td.items[key]
        if isinstance(value, (TD, LazyStack)):
            _tag = _irecv(value, src, _tag, _futures, pseudo_rand, group, group_src)
            continue
        if not isinstance(value, torch.Tensor):
            continue
        _tag = _next_tag(_tag, pseudo_rand)
        if group_src is not None:
            _futures.append(group.recv([value], group_src, _tag))
        else:
            _futures.append(dist.irecv(value, src=src, tag=_tag, group=group))
    return _tag


def irecv(td, src=None, *, group=None, group_src=None, return_premature=False, init_tag=0, pseudo_rand=False):
    _check_p2p_peer(src, group_src, group, "src", "group_src")
    futures = []
    _irecv(td, src, init_tag - 1, futures, pseudo_rand, group, group_src)
    if return_premature:
        return futures
    for f in futures:
        f.wait()
    return None


# ------------------------------------------------------------------------------------------
# Consolidation (TensorDictBase.consolidate / _reduce_vals_and_metadata) and its inverse
# (_reductions._rebuild_tensordict_files_consolidated)


def _node_metadata(td):
    return {
        "cls": "TensorDict",
        "non_tensors": {},
        "leaves": {},
        "cls_metadata": {
            "device": str(td.device) if td.device is not None else None,
            "names": td.names,
            "batch_size": list(td.batch_size),
            "is_locked": td.is_locked,
        },
    }


def _lazy_metadata(stack):
    """_reduce_vals_and_metadata's node of a LazyStackedTensorDict (_lazy.py's _reduce_get_metadata)."""
    return {"cls": "LazyStackedTensorDict", "non_tensors": {}, "leaves": {},
            "cls_metadata": {"stack_dim": stack.stack_dim, "stack_dim_name": None, "is_locked": False}}


def consolidate(td):
    """consolidate(metadata=True): a new, locked TD whose leaves view one uint8 storage. A
    LazyStack (the root or nested) is laid out as _reduce_vals_and_metadata walks one (_fast_apply
    with _NESTED_TENSORS_AS_LISTS): its members are the sub-tensordicts "0", "1", ... in order."""
    if td.consolidated is not None:
        return td
    if isinstance(td, LazyStack):
        shell = TD(td.tensordicts[0].batch_size if td.tensordicts else [])
        for m, member in enumerate(td.tensordicts):
            shell.items[str(m)] = member
        shell_c = consolidate(shell)
        out = LazyStack([shell_c.items[str(m)] for m in range(len(td.tensordicts))], td.stack_dim)
        metadata = _lazy_metadata(td)
        metadata.update({str(m): shell_c.consolidated["metadata"][str(m)] for m in range(len(td.tensordicts))})
        out.consolidated = {"storage": shell_c.consolidated["storage"], "metadata": metadata}
        return out
    need_padding = True  # consolidate passes dtype=None: every leaf is padded, whatever the dtypes
    metadata = _node_metadata(td)
    flat = []  # (path, tensor, n, pad)
    start = 0

    def assign(node, node_meta, prefix):
        nonlocal start
        for key, value in node.items.items():
            if isinstance(value, NonTensor):
                node_meta["non_tensors"][key] = (
                    value.data,
                    list(value.batch_size),
                    str(value.device) if value.device is not None else None,
                )
            elif isinstance(value, TD):
                child_meta = node_meta[key] = _node_metadata(value)
                assign(value, child_meta, prefix + (key,))
            elif isinstance(value, LazyStack):
                stack_meta = node_meta[key] = _lazy_metadata(value)
                for m, member in enumerate(value.tensordicts):
                    member_meta = stack_meta[str(m)] = _node_metadata(member)
                    assign(member, member_meta, prefix + (key, str(m)))
            else:
                n = value.element_size() * value.numel()
                pad = 0
                if need_padding:
                    pad = n % 8
                    if pad != 0:
                        pad = 8 - pad
                stop = start + n + pad
                node_meta["leaves"][key] = (str(value.dtype), list(value.shape), start, stop, pad)
                flat.append((prefix + (key,), value, n, pad))
                start = stop

    assign(td, metadata, ())
    storage = torch.zeros(start, dtype=torch.uint8)
    offset = 0
    views = {}
    for path, value, n, pad in flat:
        chunk = storage[offset:offset + n]
        chunk.copy_(value.contiguous().reshape(-1).view(torch.uint8))
        views[path] = chunk.view(value.dtype).view(value.shape)
        offset += n + pad
    assert offset == start

    def rebuild(node, prefix):
        out = TD(node.batch_size, node.device, node._names)
        for key, value in node.items.items():
            if isinstance(value, TD):
                out.items[key] = rebuild(value, prefix + (key,))
            elif isinstance(value, LazyStack):
                out.items[key] = LazyStack([rebuild(member, prefix + (key, str(m)))
                                            for m, member in enumerate(value.tensordicts)], value.stack_dim)
            elif isinstance(value, NonTensor):
                out.items[key] = value
            else:
                out.items[key] = views[prefix + (key,)]
        out.is_locked = True
        return out

    result = rebuild(td, ())
    result.consolidated = {"storage": storage, "metadata": metadata}
    return result


_STR_TO_DTYPE = {
    str(d): d
    for d in (
        torch.bfloat16, torch.bool, torch.complex128, torch.complex64, torch.float16, torch.float32,
        torch.float64, torch.int16, torch.int32, torch.int64, torch.int8, torch.uint8,
    )
}


def from_consolidated(metadata, storage):
    """_rebuild_tensordict_files_consolidated: non-tensors, then leaves, then children."""

    def from_metadata(meta):
        meta = dict(meta)
        non_tensor = meta.pop("non_tensors")
        leaves = meta.pop("leaves")
        cls = meta.pop("cls")
        cls_metadata = dict(meta.pop("cls_metadata"))
        is_locked = cls_metadata.pop("is_locked", False)
        meta.pop("size", None)
        if cls == "LazyStackedTensorDict":
            # LazyStackedTensorDict._from_dict_validated({"0": td0, ...}, stack_dim=...,
            # stack_dim_name=...): the members are the children "0", "1", ... in order.
            if non_tensor or leaves:
                raise ValueError("a LazyStackedTensorDict's metadata holds leaves of its own")
            return LazyStack([from_metadata(meta[str(m)]) for m in range(len(meta))], cls_metadata.get("stack_dim", 0))
        if cls != "TensorDict":
            raise ValueError(f"metadata names class {cls!r}; CLS_MAP knows 'TensorDict' here")
        out = TD(cls_metadata.get("batch_size", []), cls_metadata.get("device"), None)
        names = cls_metadata.get("names")
        if names is not None and any(n is not None for n in names):
            out._names = list(names)
        for key, (data, batch_size, device) in non_tensor.items():
            out.items[key] = NonTensor(data, batch_size, device)
        for key, leaf in leaves.items():
            dtype, local_shape, start, stop, pad = leaf
            dtype = _STR_TO_DTYPE[dtype]
            local_shape = torch.Size(local_shape)
            if not (0 <= start <= stop <= storage.numel()):
                raise ValueError(f"leaf {key!r}: [{start}, {stop}) outside a storage of {storage.numel()} bytes")
            value = storage[start:stop].view(dtype)
            if pad:
                value = value[: local_shape.numel()]
            out.items[key] = value.view(local_shape)
        for key, child in meta.items():
            out.items[key] = from_metadata(child)
        out.is_locked = bool(is_locked)
        return out

    result = from_metadata(metadata)
    result.consolidated = {"storage": storage, "metadata": metadata}
    return result


def _resolve_tensorclass_type(type_str):
    module_path, class_name = type_str.rsplit(".", 1)
    module = importlib.import_module(module_path)
    return getattr(module, class_name)


def _tensorclass_type_str(obj):
    cls = type(obj)
    return f"{cls.__module__}.{cls.__qualname__}"


# ------------------------------------------------------------------------------------------
# Objects over the wire (torch's send_object_list / recv_object_list / broadcast_object_list)

MAX_OBJECT_BYTES = 64 << 20


class _PlainUnpickler(pickle.Unpickler):
    """Refuses every global: tensordict's metadata is str/int/float/bool/None/list/tuple/dict."""

    def find_class(self, module, name):
        raise pickle.UnpicklingError(f"metadata pickle refers to the global {module}.{name}")


def _check_plain(obj, path="metadata", depth=0):
    if depth > 64:
        raise ValueError(f"{path}: nested deeper than 64")
    if obj is None or isinstance(obj, (str, bool, int, float)):
        return
    if isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            _check_plain(v, f"{path}[{i}]", depth + 1)
        return
    if isinstance(obj, dict):
        for k, v in obj.items():
            if not isinstance(k, str):
                raise ValueError(f"{path}: key {k!r} is not a str")
            _check_plain(v, f"{path}[{k!r}]", depth + 1)
        return
    raise ValueError(f"{path}: type {type(obj).__name__} is not a plain metadata type")


def _object_to_tensor(obj):
    f = io.BytesIO()
    pickle.Pickler(f).dump(obj)  # torch's _pickler: pickle.Pickler, default protocol
    data = f.getvalue()
    byte_tensor = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    local_size = torch.tensor([byte_tensor.numel()], dtype=torch.int64)
    return byte_tensor, local_size


def _tensor_to_object(tensor):
    obj = _PlainUnpickler(io.BytesIO(tensor.numpy().tobytes())).load()
    _check_plain(obj)
    return obj


def send_object_list(object_list, dst, group=None):
    tensors, sizes = zip(*[_object_to_tensor(o) for o in object_list])
    dist.send(torch.cat(sizes), dst=dst, group=group)
    dist.send(tensors[0] if len(tensors) == 1 else torch.cat(tensors), dst=dst, group=group)


def _sizes_checked(sizes):
    total = 0
    for s in sizes.tolist():
        if s < 0 or s > MAX_OBJECT_BYTES:
            raise ValueError(f"object size {s} out of range [0, {MAX_OBJECT_BYTES}]")
        total += s
    return total


def recv_object_list(object_list, src, group=None):
    sizes = torch.empty(len(object_list), dtype=torch.int64)
    dist.recv(sizes, src=src, group=group)
    total = _sizes_checked(sizes)
    object_tensor = torch.empty(total, dtype=torch.uint8)
    dist.recv(object_tensor, src=src, group=group)
    offset = 0
    for i, n in enumerate(sizes.tolist()):
        object_list[i] = _tensor_to_object(object_tensor[offset:offset + n])
        offset += n


def broadcast_object_list(object_list, src, group=None, use_torch=False):
    if use_torch:
        dist.broadcast_object_list(object_list, src=src, group=group)
        for o in object_list:
            _check_plain(o)
        return
    if dist.get_rank() == src:
        tensors, sizes = zip(*[_object_to_tensor(o) for o in object_list])
        sizes = torch.cat(sizes)
    else:
        sizes = torch.empty(len(object_list), dtype=torch.int64)
    dist.broadcast(sizes, src=src, group=group)
    if dist.get_rank() == src:
        object_tensor = torch.cat(tensors)
    else:
        object_tensor = torch.empty(_sizes_checked(sizes), dtype=torch.uint8)
    dist.broadcast(object_tensor, src=src, group=group)
    if dist.get_rank() != src:
        offset = 0
        for i, n in enumerate(sizes.tolist()):
            object_list[i] = _tensor_to_object(object_tensor[offset:offset + n])
            offset += n


# ------------------------------------------------------------------------------------------
# init_remote / from_remote_init / broadcast


def init_remote(td, dst=None, group=None, use_broadcast=False, _tensorclass_type=None, use_torch=False):
    if hasattr(td, "_tensordict"):  # a tensorclass: _tc_init_remote
        return init_remote(td._tensordict, dst, group, use_broadcast, _tensorclass_type_str(td), use_torch)
    if use_broadcast:
        rank = dist.get_rank(group=group)
        broadcast(td, src=rank, group=group, _tensorclass_type=_tensorclass_type, use_torch=use_torch)
        return None
    td_c = consolidate(td)
    storage = td_c.consolidated["storage"]
    metadata = td_c.consolidated["metadata"]
    metadata["_total_bytes"] = storage.numel()
    if _tensorclass_type is not None:
        metadata["_tensorclass_type"] = _tensorclass_type
    send_object_list([metadata], dst=dst, group=group)
    dist.send(storage, dst=dst, group=group)
    return td_c


def from_remote_init(src, group=None, use_broadcast=False, use_torch=False, seen=None):
    if use_broadcast:
        return broadcast(None, src=src, group=group, use_torch=use_torch, seen=seen)
    meta = [None]
    recv_object_list(meta, src=src, group=group)
    metadata = meta[0]
    if seen is not None:
        seen.append(dict(metadata))
    total_bytes = metadata.pop("_total_bytes")
    tc_type_str = metadata.pop("_tensorclass_type", None)
    if not isinstance(total_bytes, int) or not 0 <= total_bytes <= (1 << 40):
        raise ValueError(f"_total_bytes {total_bytes!r} out of range")
    storage = torch.empty(total_bytes, dtype=torch.uint8)
    dist.recv(storage, src=src, group=group)
    result = from_consolidated(metadata, storage)
    if tc_type_str is not None:
        result = _resolve_tensorclass_type(tc_type_str)._from_tensordict(result)
    return result


def broadcast(td, src, group=None, _tensorclass_type=None, use_torch=False, seen=None):
    rank = dist.get_rank(group=group)
    if rank == src:
        if hasattr(td, "_tensordict"):
            return broadcast(td._tensordict, src, group, _tensorclass_type_str(td), use_torch)
        td_c = td if td.consolidated is not None else consolidate(td)
        storage = td_c.consolidated["storage"]
        metadata = td_c.consolidated["metadata"]
        metadata["_total_bytes"] = storage.numel()
        metadata["_storage_device"] = str(storage.device)
        if _tensorclass_type is not None:
            metadata["_tensorclass_type"] = _tensorclass_type
        broadcast_object_list([metadata], src=src, group=group, use_torch=use_torch)
        dist.broadcast(storage, src=src, group=group)
        return td_c
    meta = [None]
    broadcast_object_list(meta, src=src, group=group, use_torch=use_torch)
    metadata = meta[0]
    if seen is not None:
        seen.append(dict(metadata))
    total_bytes = metadata.pop("_total_bytes")
    storage_device = metadata.pop("_storage_device")
    tc_type_str = metadata.pop("_tensorclass_type", None)
    if storage_device != "cpu":
        raise ValueError(f"_storage_device {storage_device!r}: this peer runs on CPU only")
    if not isinstance(total_bytes, int) or not 0 <= total_bytes <= (1 << 40):
        raise ValueError(f"_total_bytes {total_bytes!r} out of range")
    storage = torch.empty(total_bytes, dtype=torch.uint8)
    dist.broadcast(storage, src=src, group=group)
    result = from_consolidated(metadata, storage)
    if tc_type_str is not None:
        result = _resolve_tensorclass_type(tc_type_str)._from_tensordict(result)
    return result


# ------------------------------------------------------------------------------------------
# Collectives: reduce / all_reduce / all_gather / scatter


def reduce(td, dst, op=None, async_op=False, return_premature=False, group=None):
    if op is None:
        op = dist.ReduceOp.SUM
    return _reduce(td, dst, op, async_op, return_premature, group=group)


def _reduce(td, dst, op=None, async_op=False, return_premature=False, _future_list=None, group=None):
    if op is None:
        op = dist.ReduceOp.SUM
    root = False
    if _future_list is None:
        _future_list = []
        root = True
    for key in td.sorted_keys():
        value = td.items[key]
        if isinstance(value, TD):
            # As tensordict: the nested call does not pass `group` on.
            _future_list = _reduce(value, dst=dst, op=op, async_op=async_op, _future_list=_future_list)
            continue
        if isinstance(value, NonTensor):
            continue  # a NonTensorData: a tensor collection with no tensor leaf
        _future_list.append(dist.reduce(value, dst=dst, op=op, async_op=async_op, group=group))
    if not root:
        return _future_list
    elif async_op and return_premature:
        return _future_list
    elif async_op:
        for future in _future_list:
            future.wait()
        return


def all_reduce(td, op=None, *, group=None, async_op=False):
    if op is None:
        op = dist.ReduceOp.SUM
    futures = []
    for _, value in td.leaves_in_order():  # _fast_apply: insertion order, depth first
        futures.append(dist.all_reduce(value, op=op, group=group, async_op=async_op))
    if async_op:
        return futures
    return


def all_gather_object(object_list, obj, group=None, use_torch=False):
    """torch 1.13's all_gather_object, with this file's plain unpickler."""
    if use_torch:
        dist.all_gather_object(object_list, obj, group=group)
        for o in object_list:
            _check_plain(o)
        return
    input_tensor, local_size = _object_to_tensor(obj)
    group_size = dist.get_world_size(group=group)
    object_sizes_tensor = torch.zeros(group_size, dtype=torch.long)
    object_size_list = [object_sizes_tensor[i].unsqueeze(dim=0) for i in range(group_size)]
    dist.all_gather(object_size_list, local_size, group=group)
    max_object_size = int(max(object_size_list).item())
    _sizes_checked(object_sizes_tensor)
    padded = torch.zeros(max_object_size, dtype=torch.uint8)  # torch: input_tensor.resize_
    padded[: input_tensor.numel()] = input_tensor
    coalesced_output_tensor = torch.empty(max_object_size * group_size, dtype=torch.uint8)
    output_tensors = [coalesced_output_tensor[max_object_size * i: max_object_size * (i + 1)] for i in range(group_size)]
    dist.all_gather(output_tensors, padded, group=group)
    for i, tensor in enumerate(output_tensors):
        object_list[i] = _tensor_to_object(tensor[: int(object_size_list[i].item())])


def scatter_object_list(scatter_object_output_list, scatter_object_input_list, src=0, group=None, use_torch=False):
    """torch 1.13's scatter_object_list, with this file's plain unpickler."""
    if use_torch:
        dist.scatter_object_list(scatter_object_output_list, scatter_object_input_list, src=src, group=group)
        _check_plain(scatter_object_output_list[0])
        return
    my_rank = dist.get_rank(group)
    if my_rank == src:
        tensor_list, tensor_sizes = zip(*[_object_to_tensor(obj) for obj in scatter_object_input_list])
        tensor_list, tensor_sizes = list(tensor_list), list(tensor_sizes)
        max_tensor_size = max(tensor_sizes)
        padded_list = []
        for tensor in tensor_list:  # torch: tensor.resize_(max_tensor_size)
            buf = torch.zeros(int(max_tensor_size.item()), dtype=torch.uint8)
            buf[: tensor.numel()] = tensor
            padded_list.append(buf)
    else:
        max_tensor_size = torch.tensor([0], dtype=torch.long)
    dist.broadcast(max_tensor_size, src=src, group=group)
    _sizes_checked(max_tensor_size)
    output_tensor = torch.empty(max_tensor_size.item(), dtype=torch.uint8)
    dist.scatter(output_tensor, scatter_list=None if my_rank != src else padded_list, src=src, group=group)
    obj_tensor_size = torch.tensor([0], dtype=torch.long)
    dist.scatter(obj_tensor_size, scatter_list=None if my_rank != src else tensor_sizes, src=src, group=group)
    n = int(obj_tensor_size.item())
    if not 0 <= n <= output_tensor.numel():
        raise ValueError(f"object size {n} out of range [0, {output_tensor.numel()}]")
    scatter_object_output_list[0] = _tensor_to_object(output_tensor[:n])


def all_gather(td, *, group=None, use_torch=False, seen=None):
    world_size = dist.get_world_size(group=group)
    td_c = td if td.consolidated is not None else consolidate(td)
    storage = td_c.consolidated["storage"]
    metadata = td_c.consolidated["metadata"]
    metadata["_total_bytes"] = storage.numel()

    all_meta = [None] * world_size
    all_gather_object(all_meta, metadata, group=group, use_torch=use_torch)
    if seen is not None:
        seen.extend(dict(m) for m in all_meta)

    all_sizes = [m["_total_bytes"] for m in all_meta]
    for sz in all_sizes:
        if not isinstance(sz, int) or not 0 <= sz <= (1 << 40):
            raise ValueError(f"_total_bytes {sz!r} out of range")
    max_size = max(all_sizes)
    padded = torch.zeros(max_size, dtype=torch.uint8, device=storage.device)
    padded[: storage.numel()] = storage
    gathered = [torch.empty(max_size, dtype=torch.uint8, device=storage.device) for _ in range(world_size)]
    dist.all_gather(gathered, padded, group=group)

    result = []
    for i in range(world_size):
        m = all_meta[i]
        sz = m.pop("_total_bytes")
        result.append(from_consolidated(m, gathered[i][:sz]))
    return result


def scatter(src, tensordicts=None, *, group=None, use_torch=False, seen=None):
    rank = dist.get_rank(group=group)
    world_size = dist.get_world_size(group=group)
    if rank == src:
        consolidated = []
        for td in tensordicts:
            td = _tree_of(td)
            consolidated.append(td if td.consolidated is not None else consolidate(td))
        all_sizes = [td_c.consolidated["storage"].numel() for td_c in consolidated]
        max_size = max(all_sizes)
        storage_device = consolidated[0].consolidated["storage"].device
        all_meta = [
            {
                **td_c.consolidated["metadata"],
                "_total_bytes": td_c.consolidated["storage"].numel(),
                "_max_bytes": max_size,
                "_storage_device": str(storage_device),
            }
            for td_c in consolidated
        ]
        scatter_meta = [None] * world_size
        scatter_object_list(scatter_meta, all_meta, src=src, group=group, use_torch=use_torch)
        padded_list = []
        for td_c, sz in zip(consolidated, all_sizes):
            buf = torch.zeros(max_size, dtype=torch.uint8, device=storage_device)
            buf[:sz] = td_c.consolidated["storage"]
            padded_list.append(buf)
        recv_buf = torch.empty(max_size, dtype=torch.uint8, device=storage_device)
        dist.scatter(recv_buf, padded_list, src=src, group=group)
    else:
        scatter_meta = [None]
        scatter_object_list(scatter_meta, None, src=src, group=group, use_torch=use_torch)
        max_size = scatter_meta[0]["_max_bytes"]
        if not isinstance(max_size, int) or not 0 <= max_size <= (1 << 40):
            raise ValueError(f"_max_bytes {max_size!r} out of range")
        if scatter_meta[0]["_storage_device"] != "cpu":
            raise ValueError(f"_storage_device {scatter_meta[0]['_storage_device']!r}: this peer runs on CPU only")
        recv_buf = torch.empty(max_size, dtype=torch.uint8)
        dist.scatter(recv_buf, None, src=src, group=group)
    metadata = scatter_meta[0]
    if seen is not None:
        seen.append(dict(metadata))
    total_bytes = metadata.pop("_total_bytes")
    metadata.pop("_max_bytes")
    metadata.pop("_storage_device")
    return from_consolidated(metadata, recv_buf[:total_bytes])


# ------------------------------------------------------------------------------------------
# The trees of the tests and their values (the C++ side builds the same: tests/interop/interop_trees.cpp)

DTYPES = {
    "float32": torch.float32, "float64": torch.float64, "float16": torch.float16,
    "bfloat16": torch.bfloat16, "int64": torch.int64, "int32": torch.int32, "int16": torch.int16,
    "int8": torch.int8, "uint8": torch.uint8, "bool": torch.bool,
}


def T(path, dtype, shape):
    return ("t", tuple(path), dtype, list(shape))


def N(path, value):
    return ("n", tuple(path), value)


# Insertion order matters: it is the consolidated layout's order. Per-leaf order is sorted.
TREES = {
    # The isend example; one dtype, padded all the same (consolidate passes dtype=None).
    "seed": ([2], [T(["a", "b"], "float32", [2]), T(["c"], "float32", [2, 3]), T(["_"], "float32", [2, 1, 5])]),
    # One dtype of odd sizes: each leaf padded to 8 bytes (total 24 bytes).
    "u8only": ([], [T(["x"], "uint8", [3]), T(["n", "y"], "uint8", [5]), T(["z"], "uint8", [1])]),
    # Mixed dtypes, three levels, keys that sort "Z" < "_" < "a", odd byte sizes (padding), and
    # non-tensor values of every kind at two levels.
    "mixed": ([2], [
        T(["obs"], "float32", [2, 3]),
        N(["name"], "h\u00e9llo w\u00f6rld"),
        T(["a", "b"], "float32", [2]),
        T(["_"], "float16", [2, 1, 5]),
        N(["count"], (1 << 40) + 7),
        T(["Z"], "int64", [2]),
        T(["a", "x", "y"], "int16", [2, 3]),
        N(["a", "label"], "nested"),
        T(["mask"], "bool", [2, 3]),
        N(["ratio"], 0.1),
        T(["u8"], "uint8", [2, 5]),
        T(["d"], "float64", [2]),
        N(["flag"], True),
        T(["i8"], "int8", [2, 7]),
        T(["bf"], "bfloat16", [2, 3]),
        T(["a", "i32"], "int32", [2]),
        N(["neg"], -5),
    ]),
    # For the reductions: the dtypes gloo reduces, nested keys, insertion order unlike sorted
    # order, a non-tensor value.
    "reducible": ([2], [
        T(["obs"], "float32", [2, 3]),
        T(["n", "x"], "int64", [2, 5]),
        T(["_"], "float64", [2, 1]),
        N(["label"], "r"),
        T(["n", "deep", "y"], "int32", [2, 7]),
        T(["Z"], "uint8", [2, 3]),
    ]),
    # The tensorclass td_peer_types.InteropRecord (fields obs, action, reward).
    "record": ([3], [T(["obs"], "float32", [3, 4]), T(["action"], "int64", [3]), T(["reward"], "float32", [3, 1])]),
    # For mismatches: "probe", and variants whose ("nest", "victim_key") has another shape; another
    # dtype and byte size; another dtype of the same byte size (only the last reaches a gloo
    # receiver without breaking it).
    "probe": ([2], [T(["alpha"], "float32", [2]), T(["nest", "victim_key"], "float32", [2, 3]), T(["omega"], "float32", [2])]),
    "probe_bad_shape": ([2], [T(["alpha"], "float32", [2]), T(["nest", "victim_key"], "float32", [2, 4]), T(["omega"], "float32", [2])]),
    "probe_bad_dtype": ([2], [T(["alpha"], "float32", [2]), T(["nest", "victim_key"], "float64", [2, 3]), T(["omega"], "float32", [2])]),
    "probe_same_bytes": ([2], [T(["alpha"], "float32", [2]), T(["nest", "victim_key"], "int32", [2, 3]), T(["omega"], "float32", [2])]),
}


def fnv1a32(text):
    h = 2166136261
    for b in text.encode("utf-8"):
        h ^= b
        h = (h * 16777619) & 0xFFFFFFFF
    return h


def pattern(path, dtype, shape, salt):
    """Values of leaf `path`: v_i = (7 i + off) % 100, off = (fnv1a32("a.b") + 13 salt) % 100;
    bool: v odd; floating: (v - 50) / 8 (exact in every float type); integers: v."""
    n = 1
    for s in shape:
        n *= s
    off = (fnv1a32(".".join(path)) + 13 * salt) % 100
    v = (torch.arange(n, dtype=torch.int64) * 7 + off) % 100
    if dtype == torch.bool:
        out = (v % 2) == 1
    elif dtype.is_floating_point:
        out = ((v - 50).to(torch.float64) / 8).to(dtype)
    else:
        out = v.to(dtype)
    return out.reshape(shape)


BLANK = 111  # not a pattern value of any dtype (bool: True)


def build_tree(name, salt=0, blank=False):
    batch, entries = TREES[name]
    td = TD(batch)
    for e in entries:
        if e[0] == "t":
            _, path, dtype, shape = e
            dt = DTYPES[dtype]
            td.set(path, torch.full(shape, BLANK, dtype=dt) if blank else pattern(path, dt, shape, salt))
        else:
            td.set(e[1], e[2])
    if name == "record":
        from td_peer_types import InteropRecord
        return InteropRecord(td)
    return td


def _tree_of(x):
    return x._tensordict if hasattr(x, "_tensordict") else x


def check_tree(got, name, salt, what):
    """Every leaf and non-tensor of tree `name` (values at `salt`) is in `got`, nothing else."""
    got = _tree_of(got)
    errors = []
    batch, entries = TREES[name]
    if list(got.batch_size) != batch:
        errors.append(f"{what}: batch size {got.batch_size}, expected {batch}")
    want_leaves = set()
    for e in entries:
        path = e[1]
        try:
            value = got.get(path)
        except (KeyError, AttributeError):
            errors.append(f"{what}: key {'.'.join(path)} missing")
            continue
        if e[0] == "t":
            want_leaves.add(path)
            dt = DTYPES[e[2]]
            want = pattern(path, dt, e[3], salt)
            if not isinstance(value, torch.Tensor):
                errors.append(f"{what}: {'.'.join(path)} is not a tensor")
            elif value.dtype != dt or list(value.shape) != e[3]:
                errors.append(f"{what}: {'.'.join(path)} is {value.dtype} {list(value.shape)}, expected {dt} {e[3]}")
            elif not torch.equal(value, want):
                errors.append(f"{what}: {'.'.join(path)} = {value.flatten().tolist()[:8]}..., expected {want.flatten().tolist()[:8]}...")
        else:
            if not isinstance(value, NonTensor):
                errors.append(f"{what}: {'.'.join(path)} is not a non-tensor value")
            elif type(value.data) is not type(e[2]) or value.data != e[2]:
                errors.append(f"{what}: {'.'.join(path)} = {value.data!r}, expected {e[2]!r}")
    extra = [p for p, _ in got.leaves_in_order() if p not in want_leaves]
    if extra:
        errors.append(f"{what}: unexpected leaves {extra}")
    return errors


REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX,
              "product": dist.ReduceOp.PRODUCT}


def check_reduced(got, name, salts, op, what):
    """Every tensor leaf of tree `name` in `got` holds tree `name` at each of `salts`, reduced
    with `op` (in the leaf's dtype, as the backend reduces it)."""
    errors = []
    for e in TREES[name][1]:
        if e[0] != "t":
            continue
        path, dt = e[1], DTYPES[e[2]]
        want = pattern(path, dt, e[3], salts[0])
        for salt in salts[1:]:
            v = pattern(path, dt, e[3], salt)
            want = {"sum": torch.add, "min": torch.minimum, "max": torch.maximum, "product": torch.mul}[op](want, v)
        value = got.get(path)
        if value.dtype != dt or not torch.equal(value, want):
            errors.append(f"{what}: {'.'.join(path)} = {value.flatten().tolist()[:8]}..., expected {want.flatten().tolist()[:8]}...")
    return errors


def _normalize(obj):
    if isinstance(obj, (list, tuple)):
        return [_normalize(v) for v in obj]
    if isinstance(obj, dict):
        return {k: _normalize(v) for k, v in obj.items()}
    return obj


def _diff(a, b, path, out, notes):
    if isinstance(a, dict) and isinstance(b, dict):
        for k in a.keys() | b.keys():
            if k not in a:
                out.append(f"{path}[{k!r}] not sent (expected {b[k]!r})")
            elif k not in b:
                out.append(f"{path}[{k!r}] = {a[k]!r} unexpected")
            else:
                _diff(a[k], b[k], f"{path}[{k!r}]", out, notes)
        return
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if type(a) is not type(b):
            notes.append(f"{path}: a {type(a).__name__} where tensordict sends a {type(b).__name__}")
        if len(a) != len(b):
            out.append(f"{path} = {a!r}, expected {b!r}")
            return
        for i, (x, y) in enumerate(zip(a, b)):
            _diff(x, y, f"{path}[{i}]", out, notes)
        return
    if type(a) is not type(b) or a != b:
        out.append(f"{path} = {a!r} ({type(a).__name__}), expected {b!r} ({type(b).__name__})")


def expected_metadata(name, extra):
    tree = build_tree(name, salt=0)
    meta = dict(consolidate(_tree_of(tree)).consolidated["metadata"])
    meta["_total_bytes"] = consolidate(_tree_of(tree)).consolidated["storage"].numel()
    meta.update(extra)
    return meta


def check_metadata(seen_raw, name, extra, notes):
    """The metadata received (its pickle, loaded) against what tensordict would send."""
    want = expected_metadata(name, extra)
    errors = []
    _diff(seen_raw, want, "metadata", errors, notes)
    return errors


# ------------------------------------------------------------------------------------------
# Scenarios


class Mismatch(Exception):
    pass


def _check(errors):
    if errors:
        raise Mismatch("; ".join(errors))


def _lazy_nest_leaves(salt, blank):
    a0 = torch.full((3,), BLANK, dtype=torch.float32) if blank else torch.arange(3, dtype=torch.float32) + salt
    zz = torch.full((2,), BLANK, dtype=torch.int64) if blank else torch.arange(2, dtype=torch.int64) * (salt + 1)
    return a0, zz


def _with_lazy_nest(stack, salt, blank):
    """--lazy-nest: TD([]) {"a0": float [3], "ls": stack, "zz": int64 [2]} (tensordict's
    TestSendLazyStackNest shape: the stack's leaves at its sorted key)."""
    a0, zz = _lazy_nest_leaves(salt, blank)
    return TD([]).set("a0", a0).set("ls", stack).set("zz", zz)


def _check_lazy_nest(got, members, salt, what):
    a0, zz = _lazy_nest_leaves(salt, False)
    errors = []
    if not torch.equal(got.items["a0"], a0) or not torch.equal(got.items["zz"], zz):
        errors.append(f"{what}: the leaves beside it are {got.items['a0']}, {got.items['zz']}")
    stack = got.items["ls"]
    if not isinstance(stack, LazyStack) or len(stack.tensordicts) != len(members):
        return errors + [f"{what}: 'ls' is {type(stack).__name__}"]
    return errors + [e for m, t in enumerate(members)
                     for e in check_tree(stack.tensordicts[m], t, salt + m, f"{what}, member {m}")]


def _wait_all(works):
    for w in works:
        w.wait()


def run_scenario(args, result):
    group = None
    if args.group_ranks:
        ranks = [int(r) for r in args.group_ranks.split(",")]
        group = dist.new_group(ranks)
        result["group_ranks"] = ranks
        if args.rank not in ranks:
            return  # a non-member: it only took part in new_group
    peer = {} if args.peer is None else ({"group_dst" if args.role == "send" else "group_src": args.peer} if group is not None else
                                         {"dst" if args.role == "send" else "src": args.peer})
    if group is not None:
        peer["group"] = group

    if args.scenario == "perleaf":
        # The transferred object: tree `args.tree`, or with --lazy-members a LazyStack of those
        # trees (member m at salt + m).
        # With --lazy-nest the stack is nested: TD([]) {"a0": float [3], "ls": stack, "zz": int64
        # [2]} (tensordict's TestSendLazyStackNest shape: the stack's leaves at its sorted key).
        members = args.lazy_members.split(",") if args.lazy_members else None

        def make(blank, salt):
            if members is None:
                return build_tree(args.tree, salt, blank=blank)
            stack = LazyStack([_tree_of(build_tree(t, salt + m, blank=blank)) for m, t in enumerate(members)])
            return _with_lazy_nest(stack, salt, blank) if args.lazy_nest else stack

        def check(got):
            if members is None:
                return check_tree(got, args.tree, args.salt, "per-leaf")
            if args.lazy_nest:
                return _check_lazy_nest(got, members, args.salt, "per-leaf, nested lazy stack")
            return [e for m, t in enumerate(members)
                    for e in check_tree(got.tensordicts[m], t, args.salt + m, f"per-leaf, lazy stack member {m}")]

        if args.role == "send":
            td = make(False, args.salt)
            if args.api == "sync":
                send(_tree_of(td), init_tag=args.init_tag, pseudo_rand=args.pseudo_rand, **peer)
            elif args.api == "async":
                result["last_tag"] = isend(_tree_of(td), init_tag=args.init_tag, pseudo_rand=args.pseudo_rand, **peer)
            else:
                works = isend(_tree_of(td), init_tag=args.init_tag, pseudo_rand=args.pseudo_rand, return_early=True, **peer)
                result["works"] = len(works)
                _wait_all(works)
            if args.then_tree:  # a second transfer (after a refused one, say)
                send(_tree_of(build_tree(args.then_tree, args.salt + 1)), init_tag=args.init_tag,
                     pseudo_rand=args.pseudo_rand, **peer)
        else:
            td = _tree_of(make(True, 0))
            if args.api == "sync":
                result["last_tag"] = recv(td, init_tag=args.init_tag, pseudo_rand=args.pseudo_rand, **peer)
            elif args.api == "async":
                if irecv(td, init_tag=args.init_tag, pseudo_rand=args.pseudo_rand, **peer) is not None:
                    raise Mismatch("irecv without return_premature returned something")
            else:
                works = irecv(td, init_tag=args.init_tag, pseudo_rand=args.pseudo_rand, return_premature=True, **peer)
                result["works"] = len(works)
                _wait_all(works)
            _check(check(td))
        n = sum(sum(1 for _ in _tree_of(build_tree(t)).leaves_sorted()) for t in (members or [args.tree]))
        n += 2 if args.lazy_nest else 0
        tag = args.init_tag - 1
        for _ in range(n):
            tag = _next_tag(tag, args.pseudo_rand)
        result["expected_last_tag"] = tag
        if "last_tag" in result and result["last_tag"] != tag:
            raise Mismatch(f"last tag {result['last_tag']}, expected {tag}")
        if "works" in result and result["works"] != n:
            raise Mismatch(f"{result['works']} works, expected {n}")
        return

    if args.scenario == "consolidated" and args.lazy_members and args.lazy_nest:
        # The LazyStack nested as in perleaf's --lazy-nest, consolidated whole (one round).
        members = args.lazy_members.split(",")

        def nested(salt, blank):
            stack = LazyStack([_tree_of(build_tree(t, salt + m, blank=blank)) for m, t in enumerate(members)])
            return _with_lazy_nest(stack, salt, blank)

        if args.role == "send":
            td_c = consolidate(nested(args.salt, False))
            send(td_c, consolidated=True, **peer)
        else:
            td_c = consolidate(nested(0, True))
            recv(td_c, consolidated=True, **peer)
            _check(_check_lazy_nest(td_c, members, args.salt, "consolidated nested lazy stack"))
        result["total_bytes"] = td_c.consolidated["storage"].numel()
        return

    if args.scenario == "consolidated" and args.lazy_members:
        # A LazyStack of these trees (member m at salt + m), consolidated: two rounds into the
        # same storage, the second's values (salt + 1 + m) written in place.
        members = args.lazy_members.split(",")

        def stack(salt, blank):
            return LazyStack([_tree_of(build_tree(t, salt + m, blank=blank)) for m, t in enumerate(members)])

        if args.role == "send":
            s_c = consolidate(stack(args.salt, False))
            for r in range(args.rounds):
                if r:
                    for m, member in enumerate(s_c.tensordicts):
                        for path, leaf in member.leaves_in_order():
                            leaf.copy_(pattern(path, leaf.dtype, list(leaf.shape), args.salt + r + m))
                send(s_c, consolidated=True, **peer)
        else:
            s_c = consolidate(stack(0, True))
            for r in range(args.rounds):
                recv(s_c, consolidated=True, **peer)
                _check([e for m, t in enumerate(members)
                        for e in check_tree(s_c.tensordicts[m], t, args.salt + r + m, f"consolidated round {r}, member {m}")])
        result["total_bytes"] = s_c.consolidated["storage"].numel()
        return

    if args.scenario == "consolidated":
        # Two rounds into the same storage: salt, then salt + 1 written in place by update_.
        if args.role == "send":
            td_c = consolidate(_tree_of(build_tree(args.tree, args.salt)))
            for r in range(args.rounds):
                if r:
                    for path, leaf in td_c.leaves_in_order():
                        leaf.copy_(pattern(path, leaf.dtype, list(leaf.shape), args.salt + r))
                send(td_c, consolidated=True, **peer)
            if args.then_tree:  # a second, other storage (after a refused one, say)
                send(consolidate(_tree_of(build_tree(args.then_tree, args.salt + 1))), consolidated=True, **peer)
        else:
            td_c = consolidate(_tree_of(build_tree(args.tree, blank=True)))
            for r in range(args.rounds):
                recv(td_c, consolidated=True, **peer)
                _check(check_tree(td_c, args.tree, args.salt + r, f"consolidated round {r}"))
        result["total_bytes"] = td_c.consolidated["storage"].numel()
        return

    if args.scenario == "remote" and args.lazy_members and args.lazy_nest:
        # init_remote of the nested LazyStack (perleaf's --lazy-nest): the metadata's "ls" node
        # names LazyStackedTensorDict.
        members = args.lazy_members.split(",")
        if args.role == "send":
            stack = LazyStack([_tree_of(build_tree(t, args.salt + m)) for m, t in enumerate(members)])
            init_remote(_with_lazy_nest(stack, args.salt, False), dst=args.peer)
        else:
            seen = []
            got = from_remote_init(src=args.peer, seen=seen)
            node = seen[0].get("ls", {})
            if node.get("cls") != "LazyStackedTensorDict" or node.get("cls_metadata", {}).get("stack_dim") != 0:
                raise Mismatch(f"metadata of 'ls': {node.get('cls')!r}, {node.get('cls_metadata')!r}")
            _check(_check_lazy_nest(got, members, args.salt, "from_remote_init of a nested lazy stack"))
        return

    if args.scenario == "remote" and args.lazy_members:
        # init_remote of a LazyStack of these trees (member m at salt + m, stack_dim 0) and
        # from_remote_init of one: the metadata's root names LazyStackedTensorDict.
        members = args.lazy_members.split(",")
        if args.role == "send":
            init_remote(LazyStack([_tree_of(build_tree(t, args.salt + m)) for m, t in enumerate(members)]), dst=args.peer)
        else:
            seen = []
            got = from_remote_init(src=args.peer, seen=seen)
            if seen[0].get("cls") != "LazyStackedTensorDict" or seen[0]["cls_metadata"].get("stack_dim") != 0:
                raise Mismatch(f"metadata root {seen[0].get('cls')!r}, {seen[0].get('cls_metadata')!r}")
            if not isinstance(got, LazyStack) or len(got.tensordicts) != len(members):
                raise Mismatch(f"rebuilt {type(got)} of {len(getattr(got, 'tensordicts', []))} members")
            _check([e for m, t in enumerate(members)
                    for e in check_tree(got.tensordicts[m], t, args.salt + m, f"from_remote_init, member {m}")])
        return

    if args.scenario == "remote":
        # init_remote, then (round 1) a consolidated send of the sender's consolidated copy,
        # refreshed in place, into the receiver's from_remote_init result.
        tc = "td_peer_types.InteropRecord" if args.tree == "record" else None
        if args.role == "send":
            tree = build_tree(args.tree, args.salt)
            td_c = init_remote(tree, dst=args.peer, use_torch=args.torch_object_list)
            for r in range(1, args.rounds):
                for path, leaf in td_c.leaves_in_order():
                    leaf.copy_(pattern(path, leaf.dtype, list(leaf.shape), args.salt + r))
                send(td_c, dst=args.peer, consolidated=True)
        else:
            seen = []
            got = from_remote_init(src=args.peer, seen=seen)
            notes = []
            errors = check_metadata(seen[0], args.tree, {"_tensorclass_type": tc} if tc else {}, notes)
            result["metadata_notes"] = notes
            _check(errors)
            if tc and _tensorclass_type_str(got) != tc:
                raise Mismatch(f"rebuilt as {type(got)}, expected {tc}")
            _check(check_tree(got, args.tree, args.salt, "from_remote_init"))
            for r in range(1, args.rounds):
                recv(_tree_of(got), src=args.peer, consolidated=True)
                _check(check_tree(got, args.tree, args.salt + r, f"consolidated round {r}"))
        return

    if args.scenario == "broadcast":
        # The tree, or with --lazy-members a LazyStack of these trees (member m at salt + m),
        # whose metadata's root names LazyStackedTensorDict.
        members = args.lazy_members.split(",") if args.lazy_members else None
        tc = "td_peer_types.InteropRecord" if args.tree == "record" and members is None else None
        if args.role == "root":
            tree = (build_tree(args.tree, args.salt) if members is None else
                    LazyStack([_tree_of(build_tree(t, args.salt + m)) for m, t in enumerate(members)]))
            if args.via == "init_remote":
                init_remote(tree, use_broadcast=True, use_torch=args.torch_object_list)
            else:
                out = broadcast(tree, src=args.src, use_torch=args.torch_object_list)
                if members is None:
                    _check(check_tree(out, args.tree, args.salt, "broadcast at the root"))
        else:
            seen = []
            if args.via == "init_remote":
                got = from_remote_init(src=args.src, use_broadcast=True, use_torch=args.torch_object_list, seen=seen)
            else:
                got = broadcast(None, src=args.src, use_torch=args.torch_object_list, seen=seen)
            if members is not None:
                if seen[0].get("cls") != "LazyStackedTensorDict":
                    raise Mismatch(f"metadata root {seen[0].get('cls')!r}")
                if not isinstance(got, LazyStack) or len(got.tensordicts) != len(members):
                    raise Mismatch(f"rebuilt {type(got).__name__} of {len(getattr(got, 'tensordicts', []))} members")
                _check([e for m, t in enumerate(members)
                        for e in check_tree(got.tensordicts[m], t, args.salt + m, f"broadcast lazy stack, member {m}")])
                return
            extra = {"_storage_device": "cpu"}
            if tc:
                extra["_tensorclass_type"] = tc
            notes = []
            errors = check_metadata(seen[0], args.tree, extra, notes)
            result["metadata_notes"] = notes
            _check(errors)
            if tc and _tensorclass_type_str(got) != tc:
                raise Mismatch(f"rebuilt as {type(got)}, expected {tc}")
            _check(check_tree(got, args.tree, args.salt, "broadcast"))
        return

    if args.scenario in ("all_reduce", "reduce"):
        # Rank r holds tree `tree` at salt + r; the reference is computed here from every rank's.
        td = _tree_of(build_tree(args.tree, args.salt + args.rank))
        n = sum(1 for _ in td.leaves_in_order())
        salts = [args.salt + r for r in range(args.world)]
        op = REDUCE_OPS[args.op]
        if args.scenario == "all_reduce":
            out = all_reduce(td, op, async_op=args.api != "sync")
            if args.api == "sync":
                if out is not None:
                    raise Mismatch("all_reduce without async_op returned something")
            else:
                result["works"] = len(out)
                _wait_all(out)
            _check(check_reduced(td, args.tree, salts, args.op, "all_reduce"))
        else:
            out = reduce(td, args.dst, op, async_op=args.api != "sync", return_premature=args.api == "early")
            if args.api == "early":
                result["works"] = len(out)
                _wait_all(out)
            elif out is not None:
                raise Mismatch("reduce without return_premature returned something")
            if args.rank == args.dst:
                _check(check_reduced(td, args.tree, salts, args.op, f"reduce to {args.dst}"))
        if "works" in result and result["works"] != n:
            raise Mismatch(f"{result['works']} works, expected {n}")
        return

    if args.scenario in ("all_gather", "scatter"):
        # Rank r's tree is trees[r] at salt + r.
        trees = args.trees.split(",")
        if len(trees) != args.world:
            raise SystemExit("--trees needs one tree per rank")
        seen, notes, errors = [], [], []
        if args.scenario == "all_gather":
            got = all_gather(_tree_of(build_tree(trees[args.rank], args.salt + args.rank)),
                             use_torch=args.torch_object_list, seen=seen)
            if len(got) != args.world:
                raise Mismatch(f"{len(got)} tensordicts, expected {args.world}")
            for r, name in enumerate(trees):
                errors += check_metadata(seen[r], name, {}, notes)
                errors += check_tree(got[r], name, args.salt + r, f"all_gather from rank {r}")
        else:
            tds = [build_tree(name, args.salt + r) for r, name in enumerate(trees)] if args.rank == args.src else None
            got = scatter(args.src, tds, use_torch=args.torch_object_list, seen=seen)
            largest = max(consolidate(_tree_of(build_tree(name))).consolidated["storage"].numel() for name in trees)
            name = trees[args.rank]
            errors += check_metadata(seen[0], name, {"_max_bytes": largest, "_storage_device": "cpu"}, notes)
            errors += check_tree(got, name, args.salt + args.rank, "scatter")
        result["metadata_notes"] = notes
        _check(errors)
        return

    if args.scenario == "idle":
        return
    raise SystemExit(f"unknown scenario {args.scenario!r}")


def dump_consolidated(name):
    """Line format read by the C++ layout test:
      total <bytes>
      leaf <dotted key> <torch dtype> <shape, comma separated, or -> <start> <stop> <pad>
      storage <hex>
    (stop - start is the leaf's bytes plus its pad, as in tensordict's metadata.)"""
    td_c = consolidate(_tree_of(build_tree(name, salt=0)))
    storage = td_c.consolidated["storage"]
    print(f"total {storage.numel()}")

    def walk(meta, prefix):
        for key, (dtype, shape, start, stop, pad) in meta["leaves"].items():
            yield prefix + (key,), dtype, shape, start, stop, pad
        for key, child in meta.items():
            if key not in ("cls", "non_tensors", "leaves", "cls_metadata") and isinstance(child, dict):
                yield from walk(child, prefix + (key,))

    leaves = sorted(walk(td_c.consolidated["metadata"], ()), key=lambda l: l[3])
    for path, dtype, shape, start, stop, pad in leaves:
        print(f"leaf {'.'.join(path)} {dtype} {','.join(map(str, shape)) or '-'} {start} {stop} {pad}")
    print(f"storage {bytes(storage.numpy().tobytes()).hex()}")
    print(f"metadata {json.dumps(_normalize(td_c.consolidated['metadata']))}")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dump-consolidated", metavar="TREE[,TREE...]")
    p.add_argument("--rank", type=int)
    p.add_argument("--world", type=int)
    p.add_argument("--init-method")
    p.add_argument("--backend", default="gloo", choices=["gloo", "shm"])
    p.add_argument("--scenario", choices=["perleaf", "consolidated", "remote", "broadcast", "all_reduce", "reduce",
                                          "all_gather", "scatter", "idle"])
    p.add_argument("--role", choices=["send", "recv", "root", "member", "idle"])
    p.add_argument("--peer", type=int, help="dst/src (a group rank with --group-ranks)")
    p.add_argument("--src", type=int, default=0, help="the root of a broadcast or scatter")
    p.add_argument("--dst", type=int, default=0, help="the root of a reduce")
    p.add_argument("--op", default="sum", choices=sorted(REDUCE_OPS), help="reduce / all_reduce operation")
    p.add_argument("--trees", help="all_gather / scatter: comma-separated tree of each rank")
    p.add_argument("--tree", default="seed", choices=sorted(TREES))
    p.add_argument("--salt", type=int, default=0)
    p.add_argument("--then-tree", choices=sorted(TREES), help="send: then send this tree too (values at salt + 1)")
    p.add_argument("--lazy-members", help="perleaf, consolidated, remote, broadcast: a LazyStack of these "
                   "comma-separated trees (member m at salt + m)")
    p.add_argument("--lazy-nest", action="store_true", help="perleaf, consolidated, remote: the LazyStack nested "
                   "under 'ls' of a TD with two leaves")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--init-tag", type=int, default=0)
    p.add_argument("--pseudo-rand", action="store_true")
    p.add_argument("--api", default="sync", choices=["sync", "async", "early"],
                   help="send/recv, isend/irecv, or isend(return_early)/irecv(return_premature); reduce: "
                        "async_op, async_op with return_premature; all_reduce: async_op")
    p.add_argument("--via", default="broadcast", choices=["broadcast", "init_remote"])
    p.add_argument("--group-ranks", help="comma-separated global ranks of a new_group to address peers in")
    p.add_argument("--torch-object-list", action="store_true",
                   help="use torch's broadcast_object_list instead of this file's")
    p.add_argument("--no-barrier", action="store_true")
    p.add_argument("--timeout", type=float, default=30.0)
    args = p.parse_args(argv)

    if args.dump_consolidated:
        for name in args.dump_consolidated.split(","):
            print(f"tree {name}")
            dump_consolidated(name)
        return 0

    torch.set_num_threads(1)
    result = {"ok": False, "rank": args.rank, "backend": args.backend, "scenario": args.scenario, "role": args.role,
              "tree": args.tree}
    code = 1
    try:
        if args.backend == "shm":
            try:
                import tdshm  # noqa: F401  (registers the "shm" backend)
            except ImportError as e:
                result["error"] = f"the tdshm Python package is not importable (PYTHONPATH={os.environ.get('PYTHONPATH')!r}): {e}"
                print(json.dumps(result), flush=True)
                return 3
        dist.init_process_group(args.backend, init_method=args.init_method, rank=args.rank, world_size=args.world,
                                timeout=datetime.timedelta(seconds=args.timeout))
        run_scenario(args, result)
        if not args.no_barrier:
            dist.barrier()
        dist.destroy_process_group()
        result["ok"] = True
        code = 0
    except Mismatch as e:
        result["error"] = f"mismatch: {e}"
    except Exception as e:  # noqa: BLE001: every failure becomes the JSON line and exit 1
        result["error"] = f"{type(e).__name__}: {e}"
        traceback.print_exc(file=sys.stderr)
    print(json.dumps(result), flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
