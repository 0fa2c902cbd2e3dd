#!/usr/bin/env python3
"""Validates td_peer.py against itself (Python ranks only, gloo over file://), and its pure
parts against tensordict's documented values. Run by ctest as interop.python_self; needs only
torch and numpy. Exits non-zero on the first failure, printing what failed.

  run_peer_selftest.py [--quick] [--only NAME] [--backend gloo|shm]
"""

import argparse
import os
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
PEER = os.path.join(HERE, "td_peer.py")
sys.path.insert(0, HERE)

sys.dont_write_bytecode = True
os.environ["OMP_NUM_THREADS"] = "1"  # for the ranks, forked from this process (forked.py)
os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
import forked  # noqa: E402
import td_peer  # noqa: E402  (imports torch once, for every rank)


def check_pure():
    # docs/semantics.md ("Per-leaf mode") / tensordict's docstring of int_generator.
    def chain(init_tag, n):
        out, tag = [], init_tag - 1
        for _ in range(n):
            tag = td_peer.int_generator(tag + 1)
            out.append(tag)
        return out

    assert chain(0, 4) == [9651, 3450, 3834, 3840], chain(0, 4)
    assert chain(1, 10) == [1907, 3796, 8050, 3441, 8330, 6044, 5283, 6066, 755, 3796], chain(1, 10)
    x, seq = 10, []
    for _ in range(10):
        x = td_peer.int_generator(x)
        seq.append(x)
    assert seq == [6756, 1717, 4410, 9740, 9611, 9716, 5397, 7745, 4521, 7523], seq
    table = os.path.join(HERE, "..", "data", "pseudo_rand_tags.tsv")
    if os.path.exists(table):
        checked = 0
        with open(table) as f:
            for line in f:
                parts = line.split()
                if len(parts) != 2 or not parts[0].isdigit():
                    continue
                seed, tag = int(parts[0]), int(parts[1])
                if seed % 97 == 0:
                    assert td_peer.int_generator(seed) == tag, (seed, tag)
                    checked += 1
        assert checked > 50, checked

    # Per-leaf order of the isend example: "_", ("a", "b"), "c".
    seed = td_peer.build_tree("seed")
    assert [p for p, _ in seed.leaves_sorted()] == [("_",), ("a", "b"), ("c",)]
    mixed = td_peer.build_tree("mixed")
    order = [".".join(p) for p, _ in mixed.leaves_sorted()]
    assert order == ["Z", "_", "a.b", "a.i32", "a.x.y", "bf", "d", "i8", "mask", "obs", "u8"], order

    # Consolidated layouts: every leaf is padded to 8 bytes, one dtype or several (tensordict's
    # consolidate passes dtype=None to _reduce_vals_and_metadata, so need_padding is always true).
    def layout(name):
        c = td_peer.consolidate(td_peer._tree_of(td_peer.build_tree(name)))
        return c.consolidated["storage"].numel(), c.consolidated["metadata"]

    total, meta = layout("seed")
    assert total == 72 and meta["a"]["leaves"]["b"] == ("torch.float32", [2], 0, 8, 0), meta
    assert meta["leaves"]["_"] == ("torch.float32", [2, 1, 5], 32, 72, 0), meta
    assert meta["cls_metadata"] == {"device": None, "names": [None], "batch_size": [2], "is_locked": False}
    total, meta = layout("u8only")
    assert total == 24 and meta["n"]["leaves"]["y"] == ("torch.uint8", [5], 8, 16, 3), meta
    total, meta = layout("mixed")
    assert total == 168, total
    assert meta["leaves"]["_"] == ("torch.float16", [2, 1, 5], 56, 80, 4), meta
    assert meta["leaves"]["mask"] == ("torch.bool", [2, 3], 96, 104, 2), meta
    assert meta["non_tensors"]["count"] == ((1 << 40) + 7, [2], None), meta
    assert meta["a"]["non_tensors"]["label"] == ("nested", [2], None), meta
    assert list(meta.keys()) == ["cls", "non_tensors", "leaves", "cls_metadata", "a"], list(meta)
    assert list(meta["a"].keys()) == ["cls", "non_tensors", "leaves", "cls_metadata", "x"], list(meta["a"])

    # Rebuilding from the metadata gives the values back (non-tensors first, as tensordict does).
    c = td_peer.consolidate(mixed)
    back = td_peer.from_consolidated(c.consolidated["metadata"], c.consolidated["storage"].clone())
    errors = td_peer.check_tree(back, "mixed", 0, "rebuilt")
    assert not errors, errors
    assert list(back.items)[:5] == ["name", "count", "ratio", "flag", "neg"], list(back.items)

    # Object pickles: what torch's _object_to_tensor makes, loaded back by the plain unpickler.
    meta = dict(c.consolidated["metadata"], _total_bytes=168)
    t, size = td_peer._object_to_tensor(meta)
    assert size.dtype.is_floating_point is False and size.tolist() == [t.numel()]
    assert td_peer._tensor_to_object(t) == meta
    import pickle
    import torch
    bad = torch.frombuffer(bytearray(pickle.dumps({"x": torch.Size([1])})), dtype=torch.uint8)
    try:
        td_peer._tensor_to_object(bad)
    except pickle.UnpicklingError:
        pass
    else:
        raise AssertionError("a pickle with a global was accepted")
    print("pure checks: ok")


def run_world(name, ranks, backend, timeout=60):
    """ranks: one argument list per rank (rank and world filled in). All must exit 0."""
    with tempfile.TemporaryDirectory(prefix="td_peer_self_") as d:
        init = ("file://" + os.path.join(d, "store")) if backend == "gloo" else ("shm://tdpeer%d" % os.getpid())
        cmds, pids, logs = [], [], []
        for r, extra in enumerate(ranks):
            argv = ["--rank", str(r), "--world", str(len(ranks)), "--init-method", init, "--backend", backend,
                    "--timeout", "30"] + extra
            cmds.append([sys.executable, PEER] + argv)
            logs.append(os.path.join(d, f"rank{r}.log"))
            pids.append(forked.start(td_peer.main, (argv,), logs[-1]))
        codes, killed = forked.wait_all(pids, timeout)
        if killed or any(codes):
            print(f"FAILED {name}" + (" (killed: deadline)" if killed else ""))
            for cmd, code, log in zip(cmds, codes, logs):
                with open(log, errors="replace") as f:
                    out = f.read()
                print("  $ " + " ".join(cmd) + f"  (exit {code})")
                print("    " + out.strip().replace("\n", "\n    "))
            return False
        print(f"ok {name}")
        return True


def worlds():
    w = {}
    for api in ("sync", "async", "early"):
        w[f"perleaf_{api}"] = [["--scenario", "perleaf", "--role", "recv", "--peer", "1", "--api", api, "--tree", "mixed"],
                               ["--scenario", "perleaf", "--role", "send", "--peer", "0", "--api", api, "--tree", "mixed"]]
    w["perleaf_init_tag"] = [["--scenario", "perleaf", "--role", "send", "--peer", "1", "--init-tag", "17"],
                             ["--scenario", "perleaf", "--role", "recv", "--peer", "0", "--init-tag", "17"]]
    w["perleaf_pseudo_rand"] = [["--scenario", "perleaf", "--role", "send", "--peer", "1", "--init-tag", "1", "--pseudo-rand", "--tree", "mixed", "--api", "async"],
                                ["--scenario", "perleaf", "--role", "recv", "--peer", "0", "--init-tag", "1", "--pseudo-rand", "--tree", "mixed", "--api", "early"]]
    w["perleaf_group_dst"] = [["--scenario", "perleaf", "--role", "recv", "--peer", "1", "--group-ranks", "0,2"],
                              ["--scenario", "idle", "--role", "idle", "--group-ranks", "0,2"],
                              ["--scenario", "perleaf", "--role", "send", "--peer", "0", "--group-ranks", "0,2", "--api", "async"]]
    w["consolidated_mixed"] = [["--scenario", "consolidated", "--role", "send", "--peer", "1", "--tree", "mixed"],
                               ["--scenario", "consolidated", "--role", "recv", "--peer", "0", "--tree", "mixed"]]
    w["remote_mixed"] = [["--scenario", "remote", "--role", "recv", "--peer", "1", "--tree", "mixed"],
                         ["--scenario", "remote", "--role", "send", "--peer", "0", "--tree", "mixed"]]
    w["remote_record"] = [["--scenario", "remote", "--role", "send", "--peer", "1", "--tree", "record"],
                          ["--scenario", "remote", "--role", "recv", "--peer", "0", "--tree", "record"]]
    for via in ("broadcast", "init_remote"):
        w[f"broadcast_{via}"] = [["--scenario", "broadcast", "--role", "member", "--src", "1", "--via", via, "--tree", "mixed"],
                                 ["--scenario", "broadcast", "--role", "root", "--src", "1", "--via", via, "--tree", "mixed"],
                                 ["--scenario", "broadcast", "--role", "member", "--src", "1", "--via", via, "--tree", "mixed", "--torch-object-list"]]
    w["broadcast_record"] = [["--scenario", "broadcast", "--role", "root", "--src", "0", "--tree", "record", "--torch-object-list"],
                             ["--scenario", "broadcast", "--role", "member", "--src", "0", "--tree", "record"]]
    for op in ("sum", "min", "max", "product"):
        w[f"all_reduce_{op}"] = [["--scenario", "all_reduce", "--op", op, "--tree", "reducible", "--api", api]
                                 for api in ("sync", "async", "sync")]
        w[f"reduce_{op}"] = [["--scenario", "reduce", "--op", op, "--dst", "1", "--tree", "reducible", "--api", api]
                             for api in ("early", "sync", "async")]
    w["all_gather"] = [["--scenario", "all_gather", "--trees", "mixed,record,seed"],
                       ["--scenario", "all_gather", "--trees", "mixed,record,seed", "--torch-object-list"],
                       ["--scenario", "all_gather", "--trees", "mixed,record,seed"]]
    w["scatter"] = [["--scenario", "scatter", "--src", "1", "--trees", "seed,mixed,record"],
                    ["--scenario", "scatter", "--src", "1", "--trees", "seed,mixed,record"],
                    ["--scenario", "scatter", "--src", "1", "--trees", "seed,mixed,record", "--torch-object-list"]]
    return w


QUICK = ("perleaf_pseudo_rand", "perleaf_group_dst", "consolidated_mixed", "remote_record", "broadcast_init_remote",
         "all_reduce_product", "reduce_min", "all_gather", "scatter")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--only")
    ap.add_argument("--quick", action="store_true", help="a subset of the worlds (ctest)")
    ap.add_argument("--backend", default="gloo", choices=["gloo", "shm"])
    args = ap.parse_args()
    check_pure()
    ok = True
    for name, ranks in worlds().items():
        if args.only and args.only not in name:
            continue
        if args.quick and name not in QUICK:
            continue
        ok = run_world(name, ranks, args.backend) and ok
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
