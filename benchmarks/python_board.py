#!/usr/bin/env python3
"""tdshm.Board against TorchRL's shared-buffer pattern, for policy weights, in one run.

    PYTHONPATH=build/python python3 benchmarks/python_board.py [--mib 4] [--updates 300] [--repeat 5]
        [--spin-us 250]

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
reader's own weights (after its copy). The first includes the writer's copy into shared memory
(publish's; TorchRL's update_). The rows "board@commit" and "torchrl@notify" take the stamp after
that copy, at the publish instant: the board's writer writes the weights in place (begin()), the
stamp last, then commit(); TorchRL's writer stamps the shared weights after its update_, then
puts its queue message. What they measure is the doorbell alone. Also the reader's copy alone
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


def board_commit_writer(name, mib, updates, seen):
    board = tdshm.Board.create(name, weights(mib), readers=2)
    seen.get(timeout=30)
    for v in range(1, updates + 1):
        w = board.begin()  # a free buffer, written in place: no copy at publish
        for k, t in w.items():
            if k != "stamp":
                t.fill_(float(v))
        w["stamp"][0] = time.perf_counter_ns()
        board.commit()
        del w
        seen.get(timeout=30)


def board_reader(name, mib, updates, seen, out, spin_us):
    board = tdshm.Board.open(name, timeout=timedelta(seconds=30), spin=timedelta(microseconds=spin_us))
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


def torchrl_notify_writer(shared, mib, updates, notify, ack):
    w = weights(mib)
    for v in range(1, updates + 1):
        for k, t in w.items():
            if k != "stamp":
                t.fill_(float(v))
        for k, t in shared.items():
            if k != "stamp":
                t.copy_(w[k])
        shared["stamp"][0] = time.perf_counter_ns()  # the copy is done: the doorbell alone
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


def run(kind, mib, updates, spin_us):
    ctx = mp.get_context("fork")
    out = ctx.Queue()
    if kind.startswith("board"):
        name = "bench-{}-{}".format(os.getpid(), uuid.uuid4().hex[:8])
        seen = ctx.Queue()
        writer = board_writer if kind == "board" else board_commit_writer
        procs = [ctx.Process(target=writer, args=(name, mib, updates, seen)),
                 ctx.Process(target=board_reader, args=(name, mib, updates, seen, out, spin_us))]
    else:
        shared = weights(mib)
        for t in shared.values():
            t.share_memory_()
        notify, ack = ctx.Queue(), ctx.Queue()
        writer = torchrl_writer if kind == "torchrl" else torchrl_notify_writer
        procs = [ctx.Process(target=writer, args=(shared, mib, updates, notify, ack)),
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
    parser.add_argument("--spin-us", type=int, default=250,
                        help="the board reader's spin before it sleeps in wait_newer (Board.open(spin=))")
    args = parser.parse_args()
    src = torch.ones(args.mib * (1 << 18))
    dst = torch.empty_like(src)
    memcpy = []
    for _ in range(50):
        t = time.perf_counter_ns()
        dst.copy_(src)
        memcpy.append(time.perf_counter_ns() - t)
    kinds = ("board", "torchrl", "board@commit", "torchrl@notify")
    rows = {k: [] for k in kinds}
    for _ in range(args.repeat):
        for kind in kinds:
            rows[kind].append(run(kind, args.mib, args.updates, args.spin_us))
    print("weights {} MiB, {} updates, {} repeats; a plain {} MiB copy: {:.0f} us (p50)".format(
        args.mib, args.updates, args.repeat, args.mib, statistics.median(memcpy) / 1e3))
    for kind, runs in rows.items():
        p50 = statistics.median(pct(r[0], 0.5) for r in runs) / 1e3
        p90 = statistics.median(pct(r[0], 0.9) for r in runs) / 1e3
        u50 = statistics.median(pct(r[1], 0.5) for r in runs) / 1e3
        line = "{:14s} publish-to-visible p50 {:8.1f} us  p90 {:8.1f} us; in the reader's weights p50 {:8.1f} us".format(
            kind, p50, p90, u50)
        if runs[0][2]:
            copy = statistics.median(statistics.median(r[2]) for r in runs) / 1e3
            view = statistics.median(statistics.median(r[3]) for r in runs) / 1e3
            line += "  read (copy) {:.0f} us = {:.2f}x memcpy  view {:.1f} us".format(
                copy, statistics.median(memcpy) / 1e3 / copy, view)
        print(line)
    for b_kind, t_kind in (("board", "torchrl"), ("board@commit", "torchrl@notify")):
        b = statistics.median(pct(r[0], 0.5) for r in rows[b_kind])
        t = statistics.median(pct(r[0], 0.5) for r in rows[t_kind])
        print("{} vs {} publish-to-visible p50: {:.1f}x lower".format(b_kind, t_kind, t / b))


if __name__ == "__main__":
    main()
