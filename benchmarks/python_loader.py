#!/usr/bin/env python3
"""A data loader from Python: N workers -> main, every byte written by a worker and read by main.

    PYTHONPATH=build/python python3 benchmarks/python_loader.py [--workers 4] [--batches 2000]
        [--repeat 5] [--only loan-view,walk,...] [--read all|few]

A batch is {"image": uint8 [32,3,64,64], "label": int64 [32], "meta": {"idx": int64 [32]}}
(393,472 bytes). Each worker writes every byte of every batch (image.fill_ of a value that depends
on the worker and the batch, label, idx); main reads every byte of every batch it gets (image ==
value, all()) and checks label and idx, so that producing and consuming cost the same in every
pattern and what differs is only how the batch travels. Patterns, each in fresh processes
forked from this one (torch already imported), one after the other in each repeat:

  walk         tensordict's per-leaf send / irecv on the "shm" backend, as tensordict does it in
               Python (tests/python/td_peer.py re-implements tensordict 0.14's td.send / td.recv:
               one dist.send / dist.irecv per leaf, keys sorted); main irecvs from every worker,
               then waits (irecv-ahead)
  transfer     tdshm.Transfer(batch).send(0) / .irecv(w, return_premature=True): the same wire,
               one call into C++ per batch; main irecvs ahead from every worker
  loan-view    workers fill 4 loans in turn (tdshm.loan(batch)) and isend them by reference
               (Transfer.isend(0, return_early=True)); main takes views (Transfer.recv_view(w)):
               no copy by the transport
  torchrl      TorchRL's shared-buffer pattern: a share_memory_() batch per worker written in
               place, a multiprocessing Queue to say it is full and one per worker to say main
               is done with it (what ParallelEnv / collectors do with their pipes and queues)
  dataloader   torch.utils.data.DataLoader(num_workers=N, batch_size=None) over an iterable
               dataset that makes the batches (its default pickling through shared memory)

Prints batches/s (N x batches / seconds of main's receive loop), median and min-max over the
repeats, the ratios loan-view / walk and loan-view / torchrl, and a ceiling: the rate of main's
check alone (one batch, in cache, in this process), which no pattern can pass. tensordict itself is not
packaged for Debian; its td.send does more per leaf in Python than td_peer's walk.
"""

import argparse
import os
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests", "python"))

os.environ.setdefault("OMP_NUM_THREADS", "1")
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

import forked  # noqa: E402

BATCH = 32
IMAGE = (BATCH, 3, 64, 64)
BATCH_BYTES = BATCH * 3 * 64 * 64 + 2 * BATCH * 8
PATTERNS = ["walk", "transfer", "loan-view", "torchrl", "dataloader"]
LOANS = 4  # loans a worker fills in turn


def new_batch():
    return {"image": torch.zeros(IMAGE, dtype=torch.uint8), "label": torch.zeros(BATCH, dtype=torch.int64),
            "meta": {"idx": torch.zeros(BATCH, dtype=torch.int64)}}


def value(w, seq):
    return (seq * 31 + w * 7 + 1) % 256


def fill(batch, w, seq):
    batch["image"].fill_(value(w, seq))
    batch["label"].fill_(seq * 1000 + w)
    torch.arange(seq * BATCH, (seq + 1) * BATCH, out=batch["meta"]["idx"])


_EXPECTED = {}
READ_ALL = True  # --read few: main checks the label and idx and one image byte, not every byte


def check(batch, w, seq):
    # Every byte read once, eight at a time, against an image of the expected value (one per value,
    # kept): torch.equal compares without making a tensor of results.
    v = value(w, seq)
    if not READ_ALL:
        if int(batch["image"].view(-1)[-1]) != v:
            raise AssertionError(f"worker {w} batch {seq}: image differs")
    elif v not in _EXPECTED:
        _EXPECTED[v] = torch.full(IMAGE, v, dtype=torch.uint8).view(-1).view(torch.int64)
    if READ_ALL and not torch.equal(batch["image"].view(-1).view(torch.int64), _EXPECTED[v]):
        raise AssertionError(f"worker {w} batch {seq}: image differs")
    if int(batch["label"][0]) != seq * 1000 + w or int(batch["meta"]["idx"][BATCH - 1]) != (seq + 1) * BATCH - 1:
        raise AssertionError(f"worker {w} batch {seq}: label or idx differs")


def reading_alone(seconds=1.0):
    """Batches/s of check() alone on one filled batch (in cache): what main cannot pass."""
    batch = new_batch()
    fill(batch, 1, 0)
    check(batch, 1, 0)
    n, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        for _ in range(100):
            check(batch, 1, 0)
        n += 100
    return n / (time.perf_counter() - start)


def as_td(batch):
    import td_peer

    td = td_peer.TD([BATCH])
    td.set("image", batch["image"])
    td.set("label", batch["label"])
    td.set(("meta", "idx"), batch["meta"]["idx"])
    return td


# ---- the dist patterns: rank 0 is main ----


def _dist_rank(pattern, rank, world, init_method, batches, out):
    import td_peer
    import tdshm

    dist.init_process_group("shm", init_method=init_method, rank=rank, world_size=world)
    workers = range(1, world)
    dist.barrier()
    if rank == 0:
        plain = {w: new_batch() for w in workers}
        transfers = {w: tdshm.Transfer(plain[w]) for w in workers}
        tds = {w: as_td(plain[w]) for w in workers}
        start = time.perf_counter()
        for seq in range(batches):
            if pattern == "loan-view":
                for w in workers:
                    views = transfers[w].recv_view(w)
                    check(views, w, seq)
                    del views  # the worker may fill that loan again
            else:
                if pattern == "walk":
                    pending = [td_peer.irecv(tds[w], src=w, return_premature=True) for w in workers]
                else:
                    pending = [transfers[w].irecv(w, return_premature=True) for w in workers]
                for w, works in zip(workers, pending):
                    for work in works:
                        work.wait()
                    check(plain[w], w, seq)
        seconds = time.perf_counter() - start
        with open(out, "w") as f:
            f.write(repr(seconds))
    else:
        w = rank
        if pattern == "loan-view":
            loans = [tdshm.loan(new_batch(), dst=0) for _ in range(LOANS)]
            transfers = [tdshm.Transfer(b) for b in loans]
            sent = [[] for _ in range(LOANS)]
            for seq in range(batches):
                i = seq % LOANS
                for work in sent[i]:
                    work.wait()  # main no longer reads this loan
                fill(loans[i], w, seq)
                sent[i] = transfers[i].isend(0, return_early=True)
            for works in sent:
                for work in works:
                    work.wait()
        else:
            batch = new_batch()
            t = tdshm.Transfer(batch)
            td = as_td(batch)
            for seq in range(batches):
                fill(batch, w, seq)
                if pattern == "walk":
                    td_peer.send(td, dst=0)
                else:
                    t.send(0)
    dist.barrier()
    dist.destroy_process_group()


# ---- TorchRL's shared-buffer pattern ----


def _torchrl_worker(w, buffer, full, empty, batches):
    for seq in range(batches):
        empty.get()  # main is done with the buffer
        fill(buffer, w, seq)
        full.put(w)


def _torchrl(world, batches):
    ctx = mp.get_context("fork")
    workers = range(1, world)
    buffers = {w: new_batch() for w in workers}
    for b in buffers.values():
        for t in (b["image"], b["label"], b["meta"]["idx"]):
            t.share_memory_()
    full = ctx.Queue()
    empty = {w: ctx.Queue() for w in workers}
    procs = [ctx.Process(target=_torchrl_worker, args=(w, buffers[w], full, empty[w], batches)) for w in workers]
    for p in procs:
        p.start()
    for w in workers:
        empty[w].put(None)
    got = {w: 0 for w in workers}
    start = time.perf_counter()
    for _ in range(batches * (world - 1)):
        w = full.get()
        check(buffers[w], w, got[w])
        got[w] += 1
        empty[w].put(None)
    seconds = time.perf_counter() - start
    for p in procs:
        p.join(60)
    return seconds


# ---- DataLoader ----


class _Batches(torch.utils.data.IterableDataset):
    def __init__(self, batches):
        self.batches = batches

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        w = info.id + 1
        for seq in range(self.batches):
            batch = new_batch()
            fill(batch, w, seq)
            yield w, seq, batch


def _dataloader(world, batches):
    loader = torch.utils.data.DataLoader(_Batches(batches), batch_size=None, num_workers=world - 1,
                                         multiprocessing_context="fork")
    start = time.perf_counter()
    n = 0
    for w, seq, batch in loader:
        check(batch, int(w), int(seq))
        n += 1
    seconds = time.perf_counter() - start
    if n != batches * (world - 1):
        raise AssertionError(f"dataloader: {n} batches")
    return seconds


def run(pattern, world, batches, tmp):
    if pattern == "torchrl":
        return _torchrl(world, batches)
    if pattern == "dataloader":
        return _dataloader(world, batches)
    init = "file://" + tempfile.mktemp(dir=tmp)
    out = os.path.join(tmp, "seconds")
    pids = [forked.start(_dist_rank, (pattern, r, world, init, batches, out), os.path.join(tmp, f"rank{r}.log"))
            for r in range(world)]
    codes, killed = forked.wait_all(pids, 300)
    if any(codes) or killed:
        logs = "".join(open(os.path.join(tmp, f"rank{r}.log")).read() for r in range(world))
        raise RuntimeError(f"{pattern}: ranks exited with {codes}:\n{logs}")
    with open(out) as f:
        return float(f.read())


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--batches", type=int, default=2000, help="per worker and measurement")
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--only", default=",".join(PATTERNS))
    p.add_argument("--read", choices=("all", "few"), default="all",
                   help="what main reads of a batch: every byte, or a few (label, idx, one image byte)")
    a = p.parse_args()
    global READ_ALL
    READ_ALL = a.read == "all"
    os.environ.setdefault("TDSHM_LOAN_BYTES", str((LOANS * BATCH_BYTES + (1 << 20)) // 4096 * 4096))
    patterns = [x for x in a.only.split(",") if x]
    world = a.workers + 1
    rates = {x: [] for x in patterns}
    with tempfile.TemporaryDirectory(prefix="tdshm_pyloader_") as tmp:
        for r in range(a.repeat):
            for pattern in patterns:
                seconds = run(pattern, world, a.batches, tmp)
                rates[pattern].append(a.workers * a.batches / seconds)
                print(f"repeat {r + 1}/{a.repeat} {pattern:10s} {rates[pattern][-1]:10.1f} batches/s", file=sys.stderr)
    print(f"\nPython loader: {a.workers} workers -> main, {a.batches} batches per worker, {a.repeat} repeats, "
          f"batch {BATCH_BYTES} B (every byte written by its worker; main reads " +
          ("every byte)" if READ_ALL else "a few bytes)"))
    print(f"{'pattern':12s} {'batches/s':>11s}  {'min - max':>23s}  {'GB/s':>7s}")
    med = {}
    for pattern in patterns:
        med[pattern] = statistics.median(rates[pattern])
        print(f"{pattern:12s} {med[pattern]:11.1f}  {min(rates[pattern]):10.1f} - {max(rates[pattern]):<10.1f}  "
              f"{med[pattern] * BATCH_BYTES / 1e9:7.3f}")
    ceiling = reading_alone()
    vs = ", ".join(f"{ceiling / med[x]:.2f}x {x}" for x in ("walk", "torchrl") if med.get(x))
    print(f"ceiling: main's check alone {ceiling:.1f} batches/s (one batch in cache, this process)" +
          (f" = {vs}" if vs else ""))
    for num, den in (("loan-view", "walk"), ("loan-view", "transfer"), ("loan-view", "torchrl"),
                     ("loan-view", "dataloader"), ("walk", "torchrl")):
        if num in med and den in med:
            print(f"{num} / {den}: {med[num] / med[den]:.2f}")


if __name__ == "__main__":
    main()
