"""One Python rank of a "shm" world across simulated hosts (tests/dist/test_hosts.cpp runs it).

    hosts_rank.py RANK WORLD PORT

The C++ ranks of the world make the same calls: a ring of point-to-point messages (every rank
sends its rank to the next one, so every rank has a peer on its own host and one on the other),
all_reduce, broadcast from rank 1, barrier. Any mismatch raises: the process exits non-zero
with the traceback on stderr. Every wait has a deadline.
"""

import sys
from datetime import timedelta

import torch
import torch.distributed as dist

import tdshm  # registers the "shm" backend  # noqa: F401

TIMEOUT = timedelta(seconds=20)


def main():
    rank, world, port = (int(a) for a in sys.argv[1:4])
    dist.init_process_group("shm", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=TIMEOUT)
    nxt, prv = (rank + 1) % world, (rank - 1) % world
    out = torch.full((4,), float(rank))
    got = torch.zeros(4)
    work = dist.isend(out, nxt, tag=7)
    dist.recv(got, prv, tag=7)
    if not work.wait(TIMEOUT):
        raise AssertionError("the ring's send did not complete")
    if not torch.equal(got, torch.full((4,), float(prv))):
        raise AssertionError(f"ring: got {got.tolist()} from rank {prv}")
    t = torch.arange(5, dtype=torch.float32) + rank + 1
    dist.all_reduce(t)
    want = sum(torch.arange(5, dtype=torch.float32) + r + 1 for r in range(world))
    if not torch.allclose(t, want):
        raise AssertionError(f"all_reduce: got {t.tolist()}, expected {want.tolist()}")
    b = torch.arange(3, dtype=torch.float32) * (rank + 1)
    dist.broadcast(b, src=1)
    if not torch.equal(b, torch.arange(3, dtype=torch.float32) * 2):
        raise AssertionError(f"broadcast: got {b.tolist()}")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
