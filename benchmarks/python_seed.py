#!/usr/bin/env python3
"""The seed tree from Python: tdshm.Transfer against tensordict's per-leaf walk, and C++.

    PYTHONPATH=build/python python3 benchmarks/python_seed.py [--tool build/tools/tdshm]
        [--iters 20000] [--repeat 5] [--unpinned]

Each repeat runs, one after the other (so that every repeat sees the same minute of a noisy
machine), a two-process ping-pong of the seed tree ({("a","b"): 2 floats, "c": 2x3, "_": 2x1x5},
72 B, per-leaf) over the "shm" backend, ranks pinned to two CPUs, one-way p50 = round trip / 2:

  transfer   tdshm.Transfer(tree).send(1) / .recv(1)
  walk       tensordict's per-leaf walk in Python (tests/python/td_peer.py, the re-implementation
             of tensordict's td.send / td.recv that the interop tests check C++ against): one
             dist.send / dist.recv per leaf, keys sorted at each level
  c++        `tdshm bench --td --workloads seed --transports td-shm` (TensorDict::send / recv)

and prints the median and min-max of each over the repeats, and the ratios transfer / c++ and
walk / transfer. tensordict itself is not packaged for Debian: its own td.send does more per
leaf than the walk here (28.3 us one-way measured with tensordict v0.1.2), so walk / transfer
understates what Transfer saves against it.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests", "python"))

os.environ.setdefault("OMP_NUM_THREADS", "1")
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import forked  # noqa: E402


def seed_tree(fill):
    return {"a": {"b": torch.full((2,), fill)}, "c": torch.full((2, 3), fill), "_": torch.full((2, 1, 5), fill)}


def _rank(rank, init_method, iters, pinned, out):
    import tdshm
    import td_peer

    if pinned:
        cpus = sorted(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {cpus[rank % len(cpus)]})
    dist.init_process_group("shm", init_method=init_method, rank=rank, world_size=2)
    peer = 1 - rank
    tree = seed_tree(1.0 if rank == 0 else 0.0)
    t = tdshm.Transfer(tree)
    td = td_peer.TD([2])
    td.set(("a", "b"), tree["a"]["b"])
    td.set("c", tree["c"])
    td.set("_", tree["_"])

    def pingpong(send, recv, n):
        first, second = (send, recv) if rank == 0 else (recv, send)
        times = []
        clock = time.perf_counter_ns
        for _ in range(n // 10):  # warm-up
            first()
            second()
        for _ in range(n):
            start = clock()
            first()
            second()
            times.append(clock() - start)
        times.sort()
        return times[len(times) // 2] / 2000.0  # one way, us

    results = {
        "transfer": pingpong(lambda: t.send(peer), lambda: t.recv(peer), iters),
        "walk": pingpong(lambda: td_peer.send(td, peer), lambda: td_peer.recv(td, peer), max(200, iters // 10)),
    }
    ok = all(torch.equal(x, torch.full_like(x, 1.0)) for x in (tree["a"]["b"], tree["c"], tree["_"]))
    dist.destroy_process_group()
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"results": results, "ok": ok}, f)


def python_round(iters, pinned):
    with tempfile.TemporaryDirectory(prefix="tdshm_pyseed_") as d:
        init = "file://" + os.path.join(d, "store")
        out = os.path.join(d, "out.json")
        logs = [os.path.join(d, f"rank{r}.log") for r in range(2)]
        pids = [forked.start(_rank, (r, init, iters, pinned, out), logs[r]) for r in range(2)]
        codes, _ = forked.wait_all(pids, 300)
        if any(codes) or not os.path.exists(out):
            raise SystemExit("a Python rank failed:\n" + "".join(open(p, errors="replace").read() for p in logs))
        with open(out) as f:
            data = json.load(f)
        if not data["ok"]:
            raise SystemExit("the received seed tree holds wrong values")
        return data["results"]


def cpp_round(tool, iters, pinned):
    with tempfile.TemporaryDirectory(prefix="tdshm_pyseed_") as d:
        path = os.path.join(d, "cpp.jsonl")
        cmd = [tool, "bench", "--td", "--workloads", "seed", "--transports", "td-shm", "--iters", str(iters),
               "--json", path] + ([] if pinned else ["--no-pin"])
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        with open(path) as f:
            for line in f:
                row = json.loads(line)
                if row["transport"] == "td-shm":
                    return row["p50_us"]
    raise SystemExit("tdshm bench wrote no td-shm row")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tool", default=os.path.join(HERE, "..", "build", "tools", "tdshm"))
    ap.add_argument("--iters", type=int, default=20000)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--unpinned", action="store_true")
    args = ap.parse_args()
    rows = {"transfer": [], "walk": [], "c++": []}
    for _ in range(args.repeat):
        py = python_round(args.iters, not args.unpinned)
        rows["transfer"].append(py["transfer"])
        rows["walk"].append(py["walk"])
        rows["c++"].append(cpp_round(args.tool, args.iters, not args.unpinned))
    print(f"seed tree, one-way p50 us over {args.repeat} repeats ({'unpinned' if args.unpinned else 'pinned'}):")
    for name, v in rows.items():
        print(f"  {name:9s} median {statistics.median(v):7.3f}  min {min(v):7.3f}  max {max(v):7.3f}")
    ratio_cpp = [a / b for a, b in zip(rows["transfer"], rows["c++"])]
    ratio_walk = [a / b for a, b in zip(rows["walk"], rows["transfer"])]
    print(f"  transfer / c++   median {statistics.median(ratio_cpp):.2f} ({min(ratio_cpp):.2f}-{max(ratio_cpp):.2f}), goal <= 2")
    print(f"  walk / transfer  median {statistics.median(ratio_walk):.1f} ({min(ratio_walk):.1f}-{max(ratio_walk):.1f})")


if __name__ == "__main__":
    main()
