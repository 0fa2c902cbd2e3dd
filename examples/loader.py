#!/usr/bin/env python3
"""tdshm.DataLoader in place of torch.utils.data.DataLoader: the same arguments, the same batches,
carried from the workers to the main process through shared memory.

    PYTHONPATH=build/python python3 examples/loader.py
"""

import time

import torch
from torch.utils.data import Dataset

import tdshm


class Images(Dataset):
    """A sample per index: an image and its label."""

    def __len__(self):
        return 4096

    def __getitem__(self, i):
        return {"image": torch.full((3, 64, 64), i % 256, dtype=torch.uint8), "label": i}


def main():
    loader = tdshm.DataLoader(Images(), batch_size=32, shuffle=True, num_workers=2,
                              generator=torch.Generator().manual_seed(0))
    start = time.perf_counter()
    seen = 0
    for epoch in range(2):
        for batch in loader:
            # Every image holds its label's value: check what arrived.
            labels = batch["label"]
            assert torch.equal(batch["image"][:, 0, 0, 0], (labels % 256).to(torch.uint8))
            seen += len(labels)
    seconds = time.perf_counter() - start
    assert seen == 2 * len(Images())
    print("{} samples in {} batches of 32 over 2 epochs: {:.0f} batches/s".format(seen, seen // 32, seen / 32 / seconds))


if __name__ == "__main__":
    main()
