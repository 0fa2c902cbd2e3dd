#!/usr/bin/env python3
"""tdshm.DataLoader against torch.utils.data.DataLoader, on the same datasets, in one run.

    PYTHONPATH=build/python python3 benchmarks/python_dataloader.py [--workers 4] [--repeat 5]
        [--only whole,sample,tiny,compute] [--prefetch-factor 2] [--json FILE]

Workloads (each a map-style dataset; the loaders get the same arguments):

  whole    batch_size=None over a dataset whose items are whole batches
           {"image": uint8 [32,3,64,64], "label": int64 [32], "meta": {"idx": int64 [32]}}
  sample   per-sample {"image": uint8 [3,64,64], "label": int} made per index, batch_size=32
  tiny     a dict of 4 Python scalars per sample, batch_size=8
  sample16 the per-sample dataset with 16 us of compute per sample (a busy loop), batch_size=32:
           what a sample cost where torch's num_workers=0 ran 1,892 batches/s (528 us a batch)
  compute  the per-sample dataset with 1 ms of compute per sample (a busy loop), batch_size=8

Each repeat runs, one after the other in this process: torch's DataLoader with N workers,
tdshm.DataLoader with N workers (both with --prefetch-factor, torch's default 2 unless given: the
batches each worker may have in flight), and torch's with num_workers=0 (one process doing all the work,
no transport). Main takes every batch and drops it (it reads nothing: what differs is how the
batch travels). Prints batches/s as the median and min-max over the repeats, the ratios, and the
CPUs' bound: CPUs x the num_workers=0 rate (every CPU producing batches at the one-process rate,
main's receive costing nothing), which no loader can pass. And where the CPU goes, per batch
(/proc times of main and the workers over tdshm's window, medians): one process (num_workers=0),
tdshm's main, tdshm's workers, and what tdshm spends beyond the one process (the transport and
the protocol: tasks, headers, wake-ups). With CPU time C1 a batch in one process and C beyond it,
2 CPUs give at most 2 x C1 / (C1 + C) of the one-process rate: 1.6x needs C <= C1 / 4.
"""

import argparse
import json
import os
import statistics
import sys
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")
import torch  # noqa: E402
from torch.utils.data import DataLoader as TorchLoader  # noqa: E402
from torch.utils.data import Dataset  # noqa: E402

import tdshm  # noqa: E402


class Whole(Dataset):
    def __len__(self):
        return 1 << 30

    def __getitem__(self, i):
        return {"image": torch.full((32, 3, 64, 64), i % 256, dtype=torch.uint8), "label": torch.full((32,), i),
                "meta": {"idx": torch.arange(i * 32, (i + 1) * 32)}}


class Sample(Dataset):
    def __init__(self, busy_s=0.0):
        self.busy_s = busy_s

    def __len__(self):
        return 1 << 30

    def __getitem__(self, i):
        if self.busy_s:
            end = time.perf_counter() + self.busy_s
            while time.perf_counter() < end:
                pass
        return {"image": torch.full((3, 64, 64), i % 256, dtype=torch.uint8), "label": i}


class Tiny(Dataset):
    def __len__(self):
        return 1 << 30

    def __getitem__(self, i):
        return {"a": i, "b": float(i), "c": i % 7, "d": i * 0.5}


WORKLOADS = {
    # name: (dataset, loader arguments)
    "whole": (Whole(), {"batch_size": None}),
    "sample": (Sample(), {"batch_size": 32}),
    "tiny": (Tiny(), {"batch_size": 8}),
    "sample16": (Sample(busy_s=16e-6), {"batch_size": 32}),
    "compute": (Sample(busy_s=1e-3), {"batch_size": 8}),
}


def cpu_seconds(pid):
    """User + system CPU seconds of a process so far."""
    with open("/proc/{}/stat".format(pid)) as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def rate(cls, dataset, kwargs, workers, seconds, cpu=None, prefetch_factor=2):
    """Batches per second of main's loop over at least `seconds`, once every worker delivered
    its prefetched batches (a shorter window, or one that starts with the workers, measures
    their start: at a few thousand batches a second, the first 0.1 s says little). `cpu`, a
    dict, receives main's and the workers' CPU seconds a batch over the window."""
    if workers > 0:
        kwargs = dict(kwargs, prefetch_factor=prefetch_factor)
    loader = cls(dataset, num_workers=workers, **kwargs)
    it = iter(loader)
    for _ in range(max(1, 2 * workers * (loader.prefetch_factor or 1))):
        next(it)
    workers_pids = [w.pid for w in getattr(it, "_workers", [])]
    main_cpu = cpu_seconds(os.getpid())
    workers_cpu = sum(cpu_seconds(pid) for pid in workers_pids)
    n = 0
    start = time.perf_counter()
    while True:
        next(it)
        n += 1
        elapsed = time.perf_counter() - start
        if elapsed >= seconds:
            break
    if cpu is not None:
        cpu["main"] = (cpu_seconds(os.getpid()) - main_cpu) / n
        cpu["workers"] = (sum(cpu_seconds(pid) for pid in workers_pids) - workers_cpu) / n
    del it, loader
    return n / elapsed


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--only", default=",".join(WORKLOADS))
    parser.add_argument("--seconds", type=float, default=1.0, help="each loader's measured window")
    parser.add_argument("--prefetch-factor", type=int, default=2, help="both loaders' prefetch_factor")
    parser.add_argument("--json", help="append one JSON row per workload to this file")
    args = parser.parse_args()
    cpus = len(os.sched_getaffinity(0))
    print("tdshm.DataLoader vs torch.utils.data.DataLoader: {} workers, prefetch_factor {}, {} CPUs, {} repeats".format(
        args.workers, args.prefetch_factor, cpus, args.repeat))
    for name in args.only.split(","):
        dataset, kwargs = WORKLOADS[name]
        runs = {"torch": [], "tdshm": [], "torch0": []}
        cpus_used = {"one": [], "main": [], "workers": []}  # CPU seconds a batch
        for _ in range(args.repeat):
            pf = args.prefetch_factor
            runs["torch"].append(rate(TorchLoader, dataset, kwargs, args.workers, args.seconds, prefetch_factor=pf))
            used = {}
            runs["tdshm"].append(rate(tdshm.DataLoader, dataset, kwargs, args.workers, args.seconds, used, pf))
            cpus_used["main"].append(used["main"])
            cpus_used["workers"].append(used["workers"])
            runs["torch0"].append(rate(TorchLoader, dataset, kwargs, 0, args.seconds, used))
            cpus_used["one"].append(used["main"])
        med = {k: statistics.median(v) for k, v in runs.items()}
        us = {k: 1e6 * statistics.median(v) for k, v in cpus_used.items()}
        bound = cpus * med["torch0"]
        spread = {k: "{:.0f}-{:.0f}".format(min(v), max(v)) for k, v in runs.items()}
        print("{:8s} torch {:7.0f} ({})  tdshm {:7.0f} ({})  torch workers=0 {:7.0f} ({})  batches/s".format(
            name, med["torch"], spread["torch"], med["tdshm"], spread["tdshm"], med["torch0"], spread["torch0"]))
        ratios = [t / r for t, r in zip(runs["tdshm"], runs["torch"])]
        print("         tdshm / torch {:.1f}x (runs {:.1f}-{:.1f}); tdshm / workers=0 {:.2f}x; CPUs' bound {:.0f} "
              "batches/s: tdshm at {:.0%} of it".format(statistics.median(ratios), min(ratios), max(ratios),
                                                          med["tdshm"] / med["torch0"], bound, med["tdshm"] / bound))
        beyond = us["main"] + us["workers"] - us["one"]
        print("         CPU a batch: one process {:.0f} us; tdshm main {:.0f} + workers {:.0f} us: {:.0f} beyond "
              "one process (at most {:.2f}x workers=0 on {} CPUs)".format(
                  us["one"], us["main"], us["workers"], beyond, cpus * us["one"] / max(us["one"] + beyond, 1e-9),
                  cpus))
        if args.json:
            with open(args.json, "a") as f:
                f.write(json.dumps({"workload": name, "workers": args.workers, "prefetch_factor": args.prefetch_factor,
                                    "cpus": cpus, "runs": runs,
                                    "bound": bound, "cpu_us": us}) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
