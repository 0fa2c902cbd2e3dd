#!/usr/bin/env python3
"""tdshm.Board against TorchRL's shared-buffer pattern, for policy weights, in one run.

    PYTHONPATH=build/python python3 benchmarks/python_board.py [--mib 4] [--updates 300] [--repeat 5]

Weights: a dict of float32 tensors of --mib MiB in all, plus a "stamp" int64 [1] holding the
writer's time.perf_counter_ns() when it started the update (the clock is the machine's, shared by
the processes). One writer process updates them --updates times, waiting for the reader to have
seen each update before the next (so each latency is measured alone); one reader process:

  board    tdshm.Board: the writer publishes (one copy into a free buffer); the reader sleeps in
           wait_newer and copies the newest version into its own weights (read)
  torchrl  TorchRL's SharedMemWeightSyncScheme pattern: weights moved to shared memory once
           (share_memory_), updated in place by the writer, an mp.Queue message to say so and an
           ack queue back; the reader copies the shared weights into its own

Publish-to-visible: from the moment the writer has its new weights and starts to publish them
(the stamp) to the moment the reader learns of them (wait_newer returns; the queue's message
arrives), p50 and p90 over the updates, median of the repeats; and to the moment they are in the
reader's own weights (after its copy). Also the reader's copy alone
against a plain 4 MiB copy (the CPUs' bound for a reader that copies), and a view (Board.view).
"""

import argparse
import multiprocessing as mp
import os
import statistics
import time
import uuid
from datetime import timedelta

os.environ.setdefault("OMP_NUM_THREADS", "1")
import torch  # noqa: E402

import tdshm  # noqa: E402


def weights(mib):
    n = mib * (1 << 20) // 4 // 4
    return {"l{}".format(i): torch.zeros(n) for i in range(4)} | {"stamp": torch.zeros(1, dtype=torch.int64)}


def board_writer(name, mib, updates, seen):
    w = weights(mib)
    board = tdshm.Board.create(name, w, readers=2)
    seen.get(timeout=30)  # the reader opened the board
    for v in range(1, updates + 1):
        for k, t in w.items():
            if k != "stamp":
                t.fill_(float(v))  # new weights, ready to publish
        w["stamp"][0] = time.perf_counter_ns()
        board.publish(w)
        seen.get(timeout=30)


def board_reader(name, mib, updates, seen, out):
    board = tdshm.Board.open(name, timeout=timedelta(seconds=30))
    mine = weights(mib)
    seen.put(0)
    lat, usable, last = [], [], 0
    while last < updates:
        last = board.wait_newer(last, timedelta(seconds=30))
        visible = time.perf_counter_ns()
        last = board.read(mine)
        lat.append(visible - int(mine["stamp"][0]))
        usable.append(time.perf_counter_ns() - int(mine["stamp"][0]))
        seen.put(last)
    copies = []
    for _ in range(50):
        t = time.perf_counter_ns()
        board.read(mine)
        copies.append(time.perf_counter_ns() - t)
    views = []
    for _ in range(50):
        t = time.perf_counter_ns()
        v = board.view()
        views.append(time.perf_counter_ns() - t)
        del v
    out.put((lat, usable, copies, views))


def torchrl_writer(shared, mib, updates, notify, ack):
    w = weights(mib)
    for v in range(1, updates + 1):
        for k, t in w.items():
            if k != "stamp":
                t.fill_(float(v))  # new weights, ready to publish
        w["stamp"][0] = time.perf_counter_ns()
        for k, t in shared.items():  # update_ in place, then say so
            t.copy_(w[k])
        notify.put(v)
        ack.get(timeout=30)


def torchrl_reader(shared, mib, updates, notify, ack, out):
    mine = weights(mib)
    lat, usable = [], []
    for _ in range(updates):
        notify.get(timeout=30)
        visible = time.perf_counter_ns()
        for k, t in shared.items():
            mine[k].copy_(t)
        lat.append(visible - int(mine["stamp"][0]))
        usable.append(time.perf_counter_ns() - int(mine["stamp"][0]))
        ack.put(1)
    out.put((lat, usable, [], []))


def run(kind, mib, updates):
    ctx = mp.get_context("fork")
    out = ctx.Queue()
    if kind == "board":
        name = "bench-{}-{}".format(os.getpid(), uuid.uuid4().hex[:8])
        seen = ctx.Queue()
        procs = [ctx.Process(target=board_writer, args=(name, mib, updates, seen)),
                 ctx.Process(target=board_reader, args=(name, mib, updates, seen, out))]
    else:
        shared = weights(mib)
        for t in shared.values():
            t.share_memory_()
        notify, ack = ctx.Queue(), ctx.Queue()
        procs = [ctx.Process(target=torchrl_writer, args=(shared, mib, updates, notify, ack)),
                 ctx.Process(target=torchrl_reader, args=(shared, mib, updates, notify, ack, out))]
    for p in procs:
        p.start()
    result = out.get(timeout=120)
    for p in procs:
        p.join(30)
    return result


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib", type=int, default=4)
    parser.add_argument("--updates", type=int, default=300)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    src = torch.ones(args.mib * (1 << 18))
    dst = torch.empty_like(src)
    memcpy = []
    for _ in range(50):
        t = time.perf_counter_ns()
        dst.copy_(src)
        memcpy.append(time.perf_counter_ns() - t)
    rows = {"board": [], "torchrl": []}
    for _ in range(args.repeat):
        for kind in ("board", "torchrl"):
            rows[kind].append(run(kind, args.mib, args.updates))
    print("weights {} MiB, {} updates, {} repeats; a plain {} MiB copy: {:.0f} us (p50)".format(
        args.mib, args.updates, args.repeat, args.mib, statistics.median(memcpy) / 1e3))
    for kind, runs in rows.items():
        p50 = statistics.median(pct(r[0], 0.5) for r in runs) / 1e3
        p90 = statistics.median(pct(r[0], 0.9) for r in runs) / 1e3
        u50 = statistics.median(pct(r[1], 0.5) for r in runs) / 1e3
        line = "{:8s} publish-to-visible p50 {:8.1f} us  p90 {:8.1f} us; in the reader's weights p50 {:8.1f} us".format(
            kind, p50, p90, u50)
        if runs[0][2]:
            copy = statistics.median(statistics.median(r[2]) for r in runs) / 1e3
            view = statistics.median(statistics.median(r[3]) for r in runs) / 1e3
            line += "  read (copy) {:.0f} us = {:.2f}x memcpy  view {:.1f} us".format(
                copy, statistics.median(memcpy) / 1e3 / copy, view)
        print(line)
    b = statistics.median(pct(r[0], 0.5) for r in rows["board"])
    t = statistics.median(pct(r[0], 0.5) for r in rows["torchrl"])
    print("board vs torchrl publish-to-visible p50: {:.1f}x lower".format(t / b))


if __name__ == "__main__":
    main()
