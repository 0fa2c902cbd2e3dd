"""One Python rank of a mixed C++/Python world (tests/dist/test_mixed_world.cpp runs it).

    mixed_rank.py SCENARIO BACKEND INIT_METHOD RANK LAYOUT

LAYOUT has one letter per global rank: 'C' a C++ rank, 'P' a Python rank (this one is 'P').
RANK -1 with env:// reads RANK / WORLD_SIZE from the environment, as torch does. The scenario
mirrors the C++ side step by step; any mismatch raises, and the process exits non-zero with the
traceback on stderr. Every wait has a deadline (the group's timeout, and Work.wait(timeout)).
"""

import sys
from datetime import timedelta

import torch
import torch.distributed as dist

TIMEOUT = timedelta(seconds=20)


def expect_equal(what, got, want):
    if not torch.equal(got, want):
        raise AssertionError(f"{what}: got {got.tolist()}, expected {want.tolist()}")


def wait(work):
    if not work.wait(TIMEOUT):
        raise AssertionError("a work did not complete in time")


def gloo_scenario(rank, world, layout):
    # 1. Point to point: rank 0 sends to every rank r (tag r), r answers with value + r (tag 100 + r).
    if rank == 0:
        for r in range(1, world):
            dist.send(torch.arange(10, dtype=torch.float32) * r, dst=r, tag=r)
        for r in range(1, world):
            t = torch.zeros(10, dtype=torch.float32)
            dist.recv(t, src=r, tag=100 + r)
            expect_equal(f"reply of rank {r}", t, torch.arange(10, dtype=torch.float32) * r + r)
    else:
        t = torch.zeros(10, dtype=torch.float32)
        wait(dist.irecv(t, src=0, tag=rank))
        expect_equal("message of rank 0", t, torch.arange(10, dtype=torch.float32) * rank)
        wait(dist.isend(t + rank, dst=0, tag=100 + rank))
    # 2. all_reduce of rank + 1 (int64, 2x3).
    t = torch.full((2, 3), rank + 1, dtype=torch.int64)
    dist.all_reduce(t)
    expect_equal("all_reduce", t, torch.full((2, 3), world * (world + 1) // 2, dtype=torch.int64))
    # 3. broadcast from the last rank.
    t = torch.arange(5, dtype=torch.float64) + 42 if rank == world - 1 else torch.zeros(5, dtype=torch.float64)
    dist.broadcast(t, src=world - 1)
    expect_equal("broadcast", t, torch.arange(5, dtype=torch.float64) + 42)
    dist.barrier()
    # 4. new_group([0, world - 1]): the ranks between are non-members.
    members = [0, world - 1]
    sub = dist.new_group(members)
    if rank in members:
        t = torch.tensor([rank + 1], dtype=torch.int32)
        dist.all_reduce(t, group=sub)
        expect_equal("subgroup all_reduce", t, torch.tensor([world + 1], dtype=torch.int32))
        if rank == world - 1:
            dist.send(torch.tensor([7.0, 8.0]), dst=0, group=sub, tag=5)
        else:
            t = torch.zeros(2)
            dist.recv(t, src=world - 1, group=sub, tag=5)
            expect_equal("subgroup message", t, torch.tensor([7.0, 8.0]))
    elif sub != dist.GroupMember.NON_GROUP_MEMBER:
        raise AssertionError("a non-member got a group")
    # 5. A second subgroup of every rank (names "2"): a barrier through it.
    everyone = dist.new_group(list(range(world)))
    dist.barrier(group=everyone)
    # The end: nobody leaves while another still uses the groups.
    dist.barrier()


def shm_scenario(rank, world, layout):
    # Both directions with the C++ rank(s): rank 0 sends several dtypes to every rank, each
    # sends them back doubled; a broadcast; a shm subgroup of everyone; a barrier.
    shapes = [(torch.float32, (3, 4)), (torch.int64, (5,)), (torch.uint8, (2, 2, 2)), (torch.float64, ())]
    for step, (dtype, shape) in enumerate(shapes):
        ref = (torch.arange(max(1, torch.Size(shape).numel())) % 100).to(dtype).reshape(shape)
        if rank == 0:
            for r in range(1, world):
                dist.send(ref, dst=r, tag=step)
                back = torch.zeros_like(ref)
                dist.recv(back, src=r, tag=step)
                expect_equal(f"step {step} back from rank {r}", back, ref * 2)
        else:
            t = torch.zeros_like(ref)
            wait(dist.irecv(t, src=0, tag=step))
            expect_equal(f"step {step} from rank 0", t, ref)
            wait(dist.isend(t * 2, dst=0, tag=step))
    t = torch.arange(6, dtype=torch.float32) if rank == 0 else torch.zeros(6)
    dist.broadcast(t, src=0)
    expect_equal("broadcast", t, torch.arange(6, dtype=torch.float32))
    sub = dist.new_group(list(range(world)), backend="shm")
    t = torch.tensor([3, 1, 4]) if rank == world - 1 else torch.zeros(3, dtype=torch.int64)
    dist.broadcast(t, src=world - 1, group=sub)
    expect_equal("subgroup broadcast", t, torch.tensor([3, 1, 4]))
    dist.barrier(group=sub)
    dist.barrier()


def main():
    scenario, backend, init_method, rank, layout = sys.argv[1:6]
    rank = int(rank)
    world = len(layout)
    if backend == "shm":
        import tdshm  # noqa: F401  (registers the backend)
    kwargs = {} if rank < 0 else {"rank": rank, "world_size": world}
    dist.init_process_group(backend, init_method=init_method, timeout=TIMEOUT, **kwargs)
    rank = dist.get_rank()
    if dist.get_world_size() != world or layout[rank] != "P":
        raise AssertionError(f"rank {rank} of {dist.get_world_size()} is not a Python rank of {layout}")
    {"gloo": gloo_scenario, "shm": shm_scenario}[scenario](rank, world, layout)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
