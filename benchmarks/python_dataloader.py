#!/usr/bin/env python3
"""tdshm.DataLoader against torch.utils.data.DataLoader, on the same datasets, in one run.

    PYTHONPATH=build/python python3 benchmarks/python_dataloader.py [--workers 4] [--repeat 5]
        [--only whole,sample,tiny,compute] [--json FILE]

Workloads (each a map-style dataset; the loaders get the same arguments):

  whole    batch_size=None over a dataset whose items are whole batches
           {"image": uint8 [32,3,64,64], "label": int64 [32], "meta": {"idx": int64 [32]}}
  sample   per-sample {"image": uint8 [3,64,64], "label": int} made per index, batch_size=32
  tiny     a dict of 4 Python scalars per sample, batch_size=8
  compute  the per-sample dataset with 1 ms of compute per sample (a busy loop), batch_size=8

Each repeat runs, one after the other in this process: torch's DataLoader with N workers,
tdshm.DataLoader with N workers, and torch's with num_workers=0 (one process doing all the work,
no transport). Main takes every batch and drops it (it reads nothing: what differs is how the
batch travels). Prints batches/s as the median and min-max over the repeats, the ratios, and the
CPUs' bound: CPUs x the num_workers=0 rate (every CPU producing batches at the one-process rate,
main's receive costing nothing), which no loader can pass.
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
    "compute": (Sample(busy_s=1e-3), {"batch_size": 8}),
}


def rate(cls, dataset, kwargs, workers, seconds):
    """Batches per second of main's loop over at least `seconds`, once every worker delivered
    its prefetched batches (a shorter window, or one that starts with the workers, measures
    their start: at a few thousand batches a second, the first 0.1 s says little)."""
    loader = cls(dataset, num_workers=workers, **kwargs)
    it = iter(loader)
    for _ in range(max(1, 2 * workers * (loader.prefetch_factor or 1))):
        next(it)
    n = 0
    start = time.perf_counter()
    while True:
        next(it)
        n += 1
        elapsed = time.perf_counter() - start
        if elapsed >= seconds:
            break
    del it, loader
    return n / elapsed


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--only", default=",".join(WORKLOADS))
    parser.add_argument("--seconds", type=float, default=1.0, help="each loader's measured window")
    parser.add_argument("--json", help="append one JSON row per workload to this file")
    args = parser.parse_args()
    cpus = len(os.sched_getaffinity(0))
    print("tdshm.DataLoader vs torch.utils.data.DataLoader: {} workers, {} CPUs, {} repeats".format(
        args.workers, cpus, args.repeat))
    for name in args.only.split(","):
        dataset, kwargs = WORKLOADS[name]
        runs = {"torch": [], "tdshm": [], "torch0": []}
        for _ in range(args.repeat):
            runs["torch"].append(rate(TorchLoader, dataset, kwargs, args.workers, args.seconds))
            runs["tdshm"].append(rate(tdshm.DataLoader, dataset, kwargs, args.workers, args.seconds))
            runs["torch0"].append(rate(TorchLoader, dataset, kwargs, 0, args.seconds))
        med = {k: statistics.median(v) for k, v in runs.items()}
        bound = cpus * med["torch0"]
        spread = {k: "{:.0f}-{:.0f}".format(min(v), max(v)) for k, v in runs.items()}
        print("{:8s} torch {:7.0f} ({})  tdshm {:7.0f} ({})  torch workers=0 {:7.0f} ({})  batches/s".format(
            name, med["torch"], spread["torch"], med["tdshm"], spread["tdshm"], med["torch0"], spread["torch0"]))
        ratios = [t / r for t, r in zip(runs["tdshm"], runs["torch"])]
        print("         tdshm / torch {:.1f}x (runs {:.1f}-{:.1f}); tdshm / workers=0 {:.2f}x; CPUs' bound {:.0f} "
              "batches/s: tdshm at {:.0%} of it".format(statistics.median(ratios), min(ratios), max(ratios),
                                                          med["tdshm"] / med["torch0"], bound, med["tdshm"] / bound))
        if args.json:
            with open(args.json, "a") as f:
                f.write(json.dumps({"workload": name, "workers": args.workers, "cpus": cpus, "runs": runs,
                                    "bound": bound}) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
