"""tdshm.Transfer: a per-leaf transfer prepared once, on tensordict's wire, over "shm" and gloo.

Two Python ranks (forked children, forked.py) per world. The other side of every transfer is
td_peer.py, the Python re-implementation of tensordict's per-leaf protocol that the interop tests
check C++ against: rank 0 sends with a Transfer and rank 1 receives with tensordict's
``td.recv`` walk (every mode: send, isend, isend(return_early), init_tag and pseudo_rand), then
the other way (``Transfer.recv`` / ``irecv`` against tensordict's ``td.send``); then a leaf
replaced and a key added between two calls of one Transfer, a tensordict-like tree with a
non-tensor value, a subgroup, and the errors of bad trees and bad peers. Every wait has a
deadline; segments are checked to be gone afterwards.

Run by ctest (python.transfer) with PYTHONPATH=<build>/python.
"""

import os
import socket
import sys
import tempfile
import unittest
from datetime import timedelta

os.environ["OMP_NUM_THREADS"] = "1"
import torch  # noqa: E402
import torch.distributed  # noqa: E402,F401

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import forked  # noqa: E402

TIMEOUT = timedelta(seconds=20)
WORLD_DEADLINE = 90


def _tensors(td):
    """The tensor leaves of a td_peer.TD as nested dicts (its non-tensor values left out)."""
    import td_peer

    out = {}
    for key, value in td.items.items():
        if isinstance(value, torch.Tensor):
            out[key] = value
        elif isinstance(value, td_peer.TD):
            out[key] = _tensors(value)
    return out


def _leaves(tree, prefix=()):
    for key, value in tree.items():
        if isinstance(value, torch.Tensor):
            yield prefix + (key,), value
        else:
            yield from _leaves(value, prefix + (key,))


class _TensorDictLike:
    """What tdshm.Transfer reads of a tensordict TensorDict: its entries in ``_tensordict``."""

    def __init__(self, entries):
        self._tensordict = dict(entries)


def _worker(backend, rank, world, init_method, outdir):
    import torch.distributed as dist

    import tdshm
    import td_peer

    errors = []

    def check(cond, what):
        if not cond:
            errors.append(f"rank {rank}: {what}")

    def check_values(tree, name, salt, what):
        """Every leaf of `tree` holds tree `name` at `salt`; the leaves are those of `name`."""
        want = {tuple(e[1]): e for e in td_peer.TREES[name][1] if e[0] == "t"}
        got = dict(_leaves(tree))
        check(set(got) == set(want), f"{what}: leaves {sorted(got)} != {sorted(want)}")
        for path, t in got.items():
            if path in want:
                e = want[path]
                ref = td_peer.pattern(path, td_peer.DTYPES[e[2]], e[3], salt)
                check(torch.equal(t, ref), f"{what}: {'.'.join(path)} = {t.flatten().tolist()[:6]}")

    def expected_tags(n, init_tag, pseudo_rand):
        tags, tag = [], init_tag - 1
        for _ in range(n):
            tag = td_peer._next_tag(tag, pseudo_rand)
            tags.append(tag)
        return tags

    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world, timeout=TIMEOUT)
    if backend == "shm":
        with open(os.path.join(outdir, f"segments.{rank}"), "a") as f:
            f.write(dist.distributed_c10d._get_default_group().segment_name + "\n")
    peer = 1 - rank

    for init_tag, pseudo_rand in ((0, False), (5, True)):
        mode = f"init_tag={init_tag} pseudo_rand={pseudo_rand}"
        # Transfer -> tensordict's td.recv: send, isend (last tag), isend(return_early).
        if rank == 0:
            tree = _tensors(td_peer.build_tree("mixed", salt=1))
            t = tdshm.Transfer(tree, init_tag=init_tag, pseudo_rand=pseudo_rand)
            n = len(list(_leaves(tree)))
            check(t.tags() == expected_tags(n, init_tag, pseudo_rand), f"{mode}: tags {t.tags()}")
            check(t.keys() == sorted(path for path, _ in _leaves(tree)), f"{mode}: keys {t.keys()}")
            t.send(1)
            last = t.isend(dst=1)
            check(last == expected_tags(n, init_tag, pseudo_rand)[-1], f"{mode}: isend returned {last}")
            works = t.isend(dst=1, return_early=True)
            check(isinstance(works, list) and len(works) == n, f"{mode}: return_early gave {works!r}")
            for w in works:
                check(w.wait(TIMEOUT), f"{mode}: a send work did not complete")
        else:
            for i in range(3):
                blank = td_peer.build_tree("mixed", blank=True)
                td_peer.recv(blank, src=0, init_tag=init_tag, pseudo_rand=pseudo_rand)
                errors.extend(td_peer.check_tree(blank, "mixed", 1, f"{mode}: Transfer -> td.recv #{i}"))
        # tensordict's td.send -> Transfer: recv (last tag), irecv, irecv(return_premature).
        if rank == 1:
            for salt in (2, 3, 4):
                td_peer.send(td_peer.build_tree("mixed", salt=salt), dst=0, init_tag=init_tag, pseudo_rand=pseudo_rand)
        else:
            tree = _tensors(td_peer.build_tree("mixed", blank=True))
            t = tdshm.Transfer(tree, init_tag=init_tag, pseudo_rand=pseudo_rand)
            last = t.recv(1)
            check(last == t.tags()[-1], f"{mode}: recv returned {last}")
            check_values(tree, "mixed", 2, f"{mode}: td.send -> Transfer.recv")
            check(t.irecv(src=1) is None, f"{mode}: irecv returned something")
            check_values(tree, "mixed", 3, f"{mode}: td.send -> Transfer.irecv")
            works = t.irecv(src=1, return_premature=True)
            for w in works:
                check(w.wait(TIMEOUT), f"{mode}: a recv work did not complete")
            check_values(tree, "mixed", 4, f"{mode}: td.send -> Transfer.irecv(return_premature)")

    # One Transfer, a tree that changes between calls: a replaced leaf, then an added key.
    if rank == 0:
        tree = _tensors(td_peer.build_tree("seed", salt=1))
        t = tdshm.Transfer(tree)
        t.send(1)
        tree["c"] = td_peer.pattern(("c",), torch.float32, [2, 3], 7)  # another tensor object
        t.send(1)
        tree["a"]["z"] = torch.full((4,), 9, dtype=torch.int16)  # a new key in a nested dict
        t.send(1)
        check(("a", "z") in t.keys(), f"the added key is not among {t.keys()}")
    else:
        got = [td_peer.build_tree("seed", blank=True) for _ in range(3)]
        got[2].set(("a", "z"), torch.zeros(4, dtype=torch.int16))
        for td in got:
            td_peer.recv(td, src=0)
        errors.extend(td_peer.check_tree(got[0], "seed", 1, "before the change"))
        check(torch.equal(got[1].get("c"), td_peer.pattern(("c",), torch.float32, [2, 3], 7)),
              f"the replaced leaf was not sent: {got[1].get('c')}")
        check(torch.equal(got[2].get(("a", "z")), torch.full((4,), 9, dtype=torch.int16)),
              f"the added leaf was not sent: {got[2].get(('a', 'z'))}")

    # A tensordict-like tree (entries in _tensordict, nested), whose non-tensor value sends nothing.
    if rank == 0:
        inner = _TensorDictLike({"b": torch.arange(3.0)})
        tdl = _TensorDictLike({"x": torch.arange(4, dtype=torch.int64), "meta": "a string", "n": inner})
        t = tdshm.Transfer(tdl)
        check(t.keys() == [("n", "b"), ("x",)], f"tensordict-like keys {t.keys()}")
        t.send(1)
    else:
        td = td_peer.TD()
        td.set("x", torch.zeros(4, dtype=torch.int64))
        td.set(("n", "b"), torch.zeros(3))
        td_peer.recv(td, src=0)
        check(torch.equal(td.get("x"), torch.arange(4)) and torch.equal(td.get(("n", "b")), torch.arange(3.0)),
              "tensordict-like tree: wrong values")

    # A subgroup (group ranks differ from global ranks on neither side, but the group is passed
    # on): dst is a global rank, group_dst a group rank.
    sub = dist.new_group([0, 1])
    if rank == 0:
        t = tdshm.Transfer({"v": torch.tensor([1.0, 2.0])}, group=sub)
        t.send(dst=1)
        t.send(group_dst=1)
    else:
        for _ in range(2):
            v = torch.zeros(2)
            dist.recv(v, src=0, tag=0, group=sub)
            check(torch.equal(v, torch.tensor([1.0, 2.0])), f"subgroup: {v}")

    # Errors: bad trees (TypeError), bad peers (RuntimeError naming the parameter), before any
    # message goes out.
    for bad in ({"x": 3}, {1: torch.zeros(1)}, 5, {"a": {"b": [1, 2]}}):
        try:
            tdshm.Transfer(bad)
            errors.append(f"rank {rank}: Transfer({bad!r}) did not raise")
        except TypeError:
            pass
    t = tdshm.Transfer({"x": torch.zeros(1)})
    for call, what in ((lambda: t.send(), "no peer"), (lambda: t.send(rank), "own rank"),
                       (lambda: t.send(dst=peer, group_dst=peer), "both peers"), (lambda: t.recv(src=7), "no such rank")):
        try:
            call()
            errors.append(f"rank {rank}: {what}: no error")
        except RuntimeError:
            pass
    # send(peer) and recv(peer) take a short way into C++: what it does not take (not an int, too
    # many arguments, a peer beyond int) still raises TypeError, and so does a tree whose leaf was
    # replaced by a non-tensor since it was walked (before any message goes out).
    changed = {"x": torch.zeros(1)}
    tc = tdshm.Transfer(changed)
    changed["x"] = 3
    for call, what in ((lambda: t.send("1"), "a str peer"), (lambda: t.recv(peer, 2, 3), "three arguments"),
                       (lambda: t.send(2**40), "a peer beyond int"), (lambda: tc.send(peer), "a replaced leaf")):
        try:
            call()
            errors.append(f"rank {rank}: {what}: no error")
        except TypeError:
            pass

    dist.barrier()
    dist.destroy_process_group()
    if errors:
        raise AssertionError("\n".join(errors))


def _free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class TransferTest(unittest.TestCase):
    def run_world(self, backend):
        with tempfile.TemporaryDirectory(prefix="tdshm_pyt_") as outdir:
            init_method = f"tcp://127.0.0.1:{_free_port()}" if backend == "gloo" else "file://" + os.path.join(outdir, "store")
            logs = [os.path.join(outdir, f"rank{r}.log") for r in range(2)]
            pids = [forked.start(_worker, (backend, r, 2, init_method, outdir), logs[r]) for r in range(2)]
            codes, killed = forked.wait_all(pids, WORLD_DEADLINE)
            failed = []
            for r, code in enumerate(codes):
                if code != 0:
                    with open(logs[r], errors="replace") as f:
                        failed.append(f"rank {r} exited with {code}{' (killed at the deadline)' if killed else ''}:\n{f.read()}")
            self.assertFalse(failed, "\n".join(failed))
            for r in range(2):
                path = os.path.join(outdir, f"segments.{r}")
                if os.path.exists(path):
                    with open(path) as f:
                        for name in filter(None, (line.strip() for line in f)):
                            self.assertFalse(os.path.exists(f"/dev/shm/tdshm.{name}"), f"segment {name} left behind")

    def test_shm(self):
        self.run_world("shm")

    def test_gloo(self):
        self.run_world("gloo")


if __name__ == "__main__":
    unittest.main()
