"""tdshm.Board from Python: a writer process publishing a module's state_dict, readers in other
processes copying and viewing the newest version (never torn), wait_newer, refused trees, and
nothing left in /dev/shm.

Run by ctest (python.board) with PYTHONPATH=<build>/python.
"""

import glob
import multiprocessing as mp
import os
import threading
import time
import unittest
import uuid
from datetime import timedelta

os.environ["OMP_NUM_THREADS"] = "1"
import torch  # noqa: E402

import tdshm  # noqa: E402

VERSIONS = 400


def policy():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 8))


def fill(state, v):
    for t in state.values():
        t.fill_(float(v))


def consistent(tree, v):
    return all(bool((t == float(v)).all()) for t in tree.values())


def writer(name, ready, done):
    state = policy().state_dict()
    board = tdshm.Board.create(name, state, readers=4)
    ready.wait(20)
    for v in range(1, VERSIONS + 1):
        with torch.no_grad():
            fill(state, v)
        assert board.publish(state) == v
    done.set()
    time.sleep(0.5)  # readers finish their last read


def reader(name, ready, done, out, use_views):
    board = tdshm.Board.open(name, timeout=timedelta(seconds=20))
    mine = board.like()
    ready.set()
    last, torn, reads = 0, 0, 0
    board.wait_newer(0, timedelta(seconds=20))
    while True:
        finished = done.is_set()  # one more read after the writer's last version
        if use_views:
            view = board.view()
            v = int(next(iter(view.values())).flatten()[0])
            torn += not consistent(view, v)
            del view
        else:
            v = board.read(mine)
            torn += not consistent(mine, v)
        torn += v < last
        last = v
        reads += 1
        if finished:
            break
    out.put((reads, torn, last))


def doomed_writer(name, ready, die):
    state = policy().state_dict()
    board = tdshm.Board.create(name, state, readers=1)
    fill(state, 1)
    board.publish(state)
    ready.set()
    die.wait(30)
    os.kill(os.getpid(), 9)


def endless_writer(name, ready, stop):
    state = policy().state_dict()
    board = tdshm.Board.create(name, state, readers=1)
    ready.set()
    give_up = time.monotonic() + 60  # the test failed: end anyway
    v = 0
    while not stop.is_set() and time.monotonic() < give_up:
        v += 1
        with torch.no_grad():
            fill(state, v)
        board.publish(state)


def relay_rank(rank, init, name, host_name, ready, out):
    # A gloo world of three processes standing for two hosts: rank 0 the writer and the relay
    # sender, rank 1 the other host's relay receiver, rank 2 a reader of that host's board.
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=3)
    group = dist.group.WORLD
    state = policy().state_dict()
    try:
        if rank == 0:
            board = tdshm.Board.create(name, state, readers=2)
            relay = tdshm.BoardRelay.sender(name, group, [1], readers=2)
            ready.wait(30)
            for v in range(1, VERSIONS + 1):
                fill(state, v)
                board.publish(state)
            out.put(("sent", relay.count, relay.error))
            dist.barrier()  # the reader saw the last version
            del relay  # tells the receiver to stop
            dist.barrier()
        elif rank == 1:
            relay = tdshm.BoardRelay.receiver(host_name, state, group, 0, readers=2)
            dist.barrier()
            dist.barrier()  # the sender stopped
            relay.wait_count(10**9, timedelta(seconds=10))
            out.put(("received", relay.count, relay.stopped, relay.error))
            del relay
        else:
            board = tdshm.Board.open(host_name, timeout=timedelta(seconds=30))
            ready.set()
            mine = board.like()
            last, torn, back, seen = 0.0, 0, 0, 0
            while last < VERSIONS:
                seen = board.wait_newer(seen, timedelta(seconds=30))
                seen = board.read(mine)
                v = float(next(iter(mine.values())).flatten()[0])
                torn += not consistent(mine, v)
                back += v < last
                last = v
            out.put(("read", torn, back, last))
            dist.barrier()
            dist.barrier()
    finally:
        dist.destroy_process_group()


class BoardTest(unittest.TestCase):
    def setUp(self):
        self.name = "py-{}-{}".format(os.getpid(), uuid.uuid4().hex[:8])

    def tearDown(self):
        self.assertEqual(glob.glob("/dev/shm/tdshm-board.{}*".format(self.name)), [])

    def test_readers_see_the_newest_complete_version(self):
        ctx = mp.get_context("fork")
        ready, done, out = ctx.Event(), ctx.Event(), ctx.Queue()
        procs = [ctx.Process(target=writer, args=(self.name, ready, done))]
        procs += [ctx.Process(target=reader, args=(self.name, ready, done, out, views)) for views in (False, True)]
        for p in procs:
            p.start()
        results = [out.get(timeout=60) for _ in range(2)]
        for p in procs:
            p.join(30)
            self.assertEqual(p.exitcode, 0)
        for reads, torn, last in results:
            self.assertGreater(reads, 0)
            self.assertEqual(torn, 0)
            self.assertEqual(last, VERSIONS)  # the last read came after the last publish

    def test_threads_of_one_reader_copy_and_view(self):
        # Board.read copies without the GIL while another thread of the same reader takes views:
        # each claims a pin of its own (none is shared, none is lost), every element checked.
        ctx = mp.get_context("fork")
        ready, stop = ctx.Event(), ctx.Event()
        proc = ctx.Process(target=endless_writer, args=(self.name, ready, stop))
        proc.start()
        try:
            self.assertTrue(ready.wait(20))
            board = tdshm.Board.open(self.name, timeout=timedelta(seconds=20))
            board.wait_newer(0, timedelta(seconds=20))
            torn, counts = [], []

            def copier():
                mine, n = board.like(), 0
                for _ in range(300):
                    v = board.read(mine)
                    n += 1
                    if not consistent(mine, v):
                        torn.append(("read", v))
                counts.append(n)

            def viewer():
                n = 0
                for _ in range(300):
                    view = board.view()
                    v = int(next(iter(view.values())).flatten()[0])
                    n += 1
                    if not consistent(view, v):
                        torn.append(("view", v))
                    del view
                counts.append(n)

            threads = [threading.Thread(target=f) for f in (copier, viewer)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(60)
            self.assertEqual(torn, [])
            self.assertEqual(sorted(counts), [300, 300])
            kept = [board.view(), board.view()]  # both pins came back
            with self.assertRaisesRegex(RuntimeError, "drop one"):
                board.view()
            mine = board.like()
            v = board.read(mine)  # no pin free: copied as a seqlock reader does
            self.assertTrue(consistent(mine, v))
            del kept, board
        finally:
            stop.set()
            proc.join(30)
        self.assertEqual(proc.exitcode, 0)

    def test_waits_and_refusals(self):
        state = policy().state_dict()
        board = tdshm.Board.create(self.name, state, readers=1)
        reader_board = tdshm.Board.open(self.name)
        with self.assertRaises(TimeoutError):
            reader_board.wait_newer(0, timedelta(milliseconds=30))
        self.assertEqual(reader_board.read(reader_board.like()), 0)
        self.assertEqual(board.publish(state), 1)
        self.assertEqual(reader_board.wait_newer(0, timedelta(seconds=1)), 1)
        wrong = dict(state)
        wrong["0.weight"] = torch.zeros(3)
        with self.assertRaisesRegex(RuntimeError, "0.weight"):
            board.publish(wrong)
        with self.assertRaisesRegex(RuntimeError, "2.bias"):
            reader_board.read({k: v for k, v in state.items() if k != "2.bias"})
        with self.assertRaises(TypeError):
            board.publish([1, 2])
        views = [reader_board.view(), reader_board.view()]
        with self.assertRaisesRegex(RuntimeError, "drop one"):
            reader_board.view()
        del views
        reader_board.view()
        del board  # the writer's Board: its readers' waits end at once
        with self.assertRaisesRegex(RuntimeError, "closed it at version 1"):
            reader_board.wait_newer(1, timedelta(seconds=30))
        del reader_board

    def test_long_waits_answer_ctrl_c_and_forever_is_forever(self):
        # A signal handler's exception (Ctrl-C's KeyboardInterrupt) ends a long wait_newer or open
        # at once, not at its timeout; timedelta.max waits instead of timing out at once.
        import signal

        class Interrupted(Exception):
            pass

        def interrupt(signum, frame):
            raise Interrupted()

        previous = signal.signal(signal.SIGALRM, interrupt)
        try:
            board = tdshm.Board.create(self.name, {"w": torch.zeros(4)}, readers=1)
            reader_board = tdshm.Board.open(self.name, timeout=timedelta.max)
            for wait in (lambda: reader_board.wait_newer(0, timedelta(seconds=20)),
                         lambda: tdshm.Board.open(self.name + "-none", timeout=timedelta(seconds=20)),
                         lambda: reader_board.wait_newer(0, timedelta.max)):
                signal.setitimer(signal.ITIMER_REAL, 0.3)
                start = time.monotonic()
                with self.assertRaises(Interrupted):
                    wait()
                self.assertLess(time.monotonic() - start, 3.0, "the wait ran on past the signal")
            threading.Timer(0.1, lambda: board.publish({"w": torch.ones(4)})).start()
            self.assertEqual(reader_board.wait_newer(0, timedelta.max), 1)
            with self.assertRaisesRegex(TimeoutError, "within 30 ms"):
                reader_board.wait_newer(1, timedelta(milliseconds=30))
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)
        del board
        with self.assertRaisesRegex(RuntimeError, "closed it at version 1"):
            reader_board.wait_newer(1, timedelta(0))  # a poller is told, not timed out
        del reader_board

    def test_close_and_with(self):
        with tdshm.Board.create(self.name, {"w": torch.zeros(4)}, readers=1) as board:
            with tdshm.Board.open(self.name) as reader_board:
                self.assertEqual(board.publish({"w": torch.ones(4)}), 1)
                self.assertFalse(board.closed)
            self.assertTrue(reader_board.closed)
            with self.assertRaisesRegex(RuntimeError, "closed"):
                reader_board.read({"w": torch.zeros(4)})
            again = tdshm.Board.open(self.name, timeout=timedelta(seconds=1))  # the slot came back
        self.assertTrue(board.closed)
        with self.assertRaisesRegex(RuntimeError, "the board was closed"):
            board.publish({"w": torch.ones(4)})
        with self.assertRaisesRegex(RuntimeError, "closed it at version 1"):
            again.wait_newer(1, timedelta(seconds=10))
        mine = {"w": torch.zeros(4)}
        self.assertEqual(again.read(mine), 1)
        self.assertTrue(torch.equal(mine["w"], torch.ones(4)))
        board.close()  # twice is nothing
        again.close()

    def test_a_dead_writers_reader_is_told_and_removes_its_file(self):
        # The writer is killed: wait_newer raises at once (RuntimeError naming it), not after its
        # timeout, the last version stays readable, and the reader's going removes the file.
        ctx = mp.get_context("fork")
        ready, die = ctx.Event(), ctx.Event()
        w = ctx.Process(target=doomed_writer, args=(self.name, ready, die))
        w.start()
        try:
            self.assertTrue(ready.wait(20), "the writer did not publish")
            board = tdshm.Board.open(self.name)
            self.assertEqual(board.wait_newer(0, timedelta(seconds=10)), 1)
            die.set()
            w.join(20)
            self.assertEqual(w.exitcode, -9)
            start = time.monotonic()
            with self.assertRaisesRegex(RuntimeError, r"\(pid {}\) died at version 1".format(w.pid)):
                board.wait_newer(1, timedelta(seconds=30))
            self.assertLess(time.monotonic() - start, 2.0)
            mine = board.like()
            self.assertEqual(board.read(mine), 1)
            self.assertTrue(consistent(mine, 1))
            self.assertEqual(len(glob.glob("/dev/shm/tdshm-board.{}".format(self.name))), 1)
            del board
        finally:
            if w.is_alive():
                w.kill()
                w.join()

    def test_a_version_written_in_place(self):
        # begin() hands the writer a free buffer's tensors (no copy); readers see the version only
        # once commit() published it.
        state = policy().state_dict()
        board = tdshm.Board.create(self.name, state, readers=1)
        reader_board = tdshm.Board.open(self.name)
        slot = board.begin()
        self.assertEqual(set(slot), set(state))
        for t in slot.values():
            t.fill_(3.0)
        with self.assertRaisesRegex(RuntimeError, "commit"):
            board.publish(state)
        self.assertEqual(reader_board.version, 0)
        self.assertEqual(board.commit(), 1)
        mine = reader_board.like()
        self.assertEqual(reader_board.read(mine), 1)
        self.assertTrue(all(bool((t == 3.0).all()) for t in mine.values()))
        with self.assertRaisesRegex(RuntimeError, "no begin"):
            board.commit()
        del slot, board, reader_board, mine

    def test_a_board_across_hosts(self):
        # tdshm.BoardRelay over a gloo world: the other host's reader sees every version whole,
        # never going back, up to the writer's last.
        import tempfile
        ctx = mp.get_context("fork")
        ready, out = ctx.Event(), ctx.Queue()
        host_name = self.name + "-h"
        with tempfile.TemporaryDirectory() as tmp:
            init = "file://" + os.path.join(tmp, "rendezvous")
            procs = [ctx.Process(target=relay_rank, args=(r, init, self.name, host_name, ready, out)) for r in range(3)]
            for p in procs:
                p.start()
            results = {}
            for _ in range(3):
                got = out.get(timeout=60)
                results[got[0]] = got[1:]
            for p in procs:
                p.join(30)
                self.assertEqual(p.exitcode, 0)
        sent, sent_error = results["sent"]
        received, stopped, received_error = results["received"]
        torn, back, last = results["read"]
        self.assertEqual((torn, back, last), (0, 0, VERSIONS))
        self.assertEqual((sent_error, received_error), ("", ""))
        self.assertTrue(stopped)
        self.assertGreaterEqual(received, 1)
        self.assertLessEqual(received, VERSIONS)
        self.assertEqual(glob.glob("/dev/shm/tdshm-board.{}*".format(host_name)), [])


if __name__ == "__main__":
    unittest.main()
