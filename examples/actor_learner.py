#!/usr/bin/env python3
"""An actor-learner loop: the learner publishes its policy's weights on a tdshm.Board, actors
read the newest version when they start an episode, and send their trajectories back as loans
(tdshm.empty + dist.send over the "shm" backend; the learner receives views, no copy).

    PYTHONPATH=build/python python3 examples/actor_learner.py
"""

import os
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import tdshm

ACTORS = 2
EPISODES = 50  # per actor
STEPS = 64  # per episode


def policy():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))


def actor(rank, init, board_name):
    dist.init_process_group("shm", init_method=init, rank=rank, world_size=ACTORS + 1)
    torch.set_num_threads(1)
    net = policy()
    board = tdshm.Board.open(board_name)
    weights = net.state_dict()  # its tensors are the parameters: read() copies into them
    buffers = [{"obs": tdshm.empty((STEPS, 8)), "action": tdshm.empty((STEPS,), dtype=torch.int64),
                "version": tdshm.empty((1,), dtype=torch.int64)} for _ in range(2)]
    sends = [[], []]
    for episode in range(EPISODES):
        version = board.read(weights)  # the newest complete version, never a torn one
        # Every weight of version v holds v: the learner's "training" (see below).
        assert all(bool((t == version).all()) for t in weights.values()), version
        buf = buffers[episode % 2]
        for w in sends[episode % 2]:  # the learner dropped its views of this buffer's last episode
            w.wait()
        with torch.no_grad():
            buf["obs"].normal_()
            buf["action"].copy_(net(buf["obs"]).argmax(-1))
        buf["version"].fill_(version)
        sends[episode % 2] = [dist.isend(buf[k], dst=0) for k in ("obs", "action", "version")]
    for ws in sends:
        for w in ws:
            w.wait()
    dist.barrier()
    dist.destroy_process_group()


def main():
    with tempfile.TemporaryDirectory() as tmp:
        init = "file://" + os.path.join(tmp, "rendezvous")
        board_name = "example-al-{}".format(os.getpid())
        net = policy()
        board = tdshm.Board.create(board_name, net.state_dict(), readers=ACTORS)
        version = 1
        with torch.no_grad():
            for p in net.parameters():
                p.fill_(version)
        board.publish(net.state_dict())
        ctx = mp.get_context("fork")
        procs = [ctx.Process(target=actor, args=(r, init, board_name)) for r in range(1, ACTORS + 1)]
        for p in procs:
            p.start()
        dist.init_process_group("shm", init_method=init, rank=0, world_size=ACTORS + 1)
        start = time.perf_counter()
        stale = 0
        for episode in range(EPISODES):
            for a in range(1, ACTORS + 1):
                obs = tdshm.recv_view(a)  # views of the actor's loans
                action = tdshm.recv_view(a)
                used = int(tdshm.recv_view(a)[0])
                assert obs.shape == (STEPS, 8) and action.shape == (STEPS,) and 1 <= used <= version
                assert bool(((action >= 0) & (action < 4)).all())
                stale += version - used
                del obs, action  # the actor may refill that buffer now
            # "Training": the next version's weights all hold its number; published without
            # waiting for any actor.
            version += 1
            with torch.no_grad():
                for p in net.parameters():
                    p.fill_(version)
            board.publish(net.state_dict())
        seconds = time.perf_counter() - start
        dist.barrier()
        for p in procs:
            p.join(30)
            assert p.exitcode == 0, p.exitcode
        dist.destroy_process_group()
        print("{} episodes of {} actors in {:.2f} s, {} weight versions; an episode's weights were {:.2f} "
              "versions old on average".format(EPISODES, ACTORS, seconds, version, stale / (EPISODES * ACTORS)))


if __name__ == "__main__":
    main()
