"""The Python package tdshm: the "shm" backend through torch.distributed.

Each test runs a world of Python rank processes (children forked from the test, with torch and
tdshm already imported: forked.py; each runs ``_worker(SCENARIO, RANK, WORLD, INIT_METHOD,
OUTDIR)``), waits for all of them with one deadline (killing what is left), and checks their
exit codes. Every group has a
timeout, every Work.wait too. Each world records the segment names it used (OUTDIR/segments.<rank>);
afterwards none of them, and no new tdshm.pg-* segment, may be left in /dev/shm.

Run by ctest (python.shm_backend) with PYTHONPATH=<build>/python.
"""

import os
import socket
import sys
import tempfile
import time
import unittest
from datetime import timedelta

os.environ["OMP_NUM_THREADS"] = "1"  # for the ranks (set before torch reads it)
import torch  # noqa: E402,F401  (imported once here: every rank is forked from this process)
import torch.distributed  # noqa: E402,F401

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import forked  # noqa: E402

TIMEOUT = timedelta(seconds=20)
WORLD_DEADLINE = 90  # seconds for a whole world, then its processes are killed


# ---------------------------------------------------------------------------------------------
# Worker side (a rank)


def _worker(scenario, rank, world, init_method, outdir):
    import torch
    import torch.distributed as dist

    import tdshm

    def record(pg):
        with open(os.path.join(outdir, f"segments.{rank}"), "a") as f:
            f.write(pg.segment_name + "\n")

    def expect_equal(what, got, want):
        if got.dtype != want.dtype or not torch.equal(got, want):
            raise AssertionError(f"rank {rank}: {what}: got {got}, expected {want}")

    def wait(work):
        if not work.wait(TIMEOUT):
            raise AssertionError("a work did not complete in time")

    dist.init_process_group("shm", init_method=init_method, rank=rank, world_size=world, timeout=TIMEOUT)
    default_pg = dist.distributed_c10d._get_default_group()
    if not isinstance(default_pg, tdshm.ProcessGroupShm):
        raise AssertionError(f"the default group is a {type(default_pg)}")
    if dist.get_backend() != "shm" or dist.get_rank() != rank or dist.get_world_size() != world:
        raise AssertionError("backend, rank or world size differ")
    record(default_pg)

    if scenario == "p2p":
        # Several dtypes and shapes, contiguous and not, both ways between ranks 0 and 1.
        cases = []
        for i, dtype in enumerate([torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64,
                                   torch.int32, torch.int8, torch.uint8, torch.bool, torch.complex64]):
            for shape in [(), (0,), (7,), (3, 4, 5), (1000, 33)]:
                n = 1
                for d in shape:
                    n *= d
                base = torch.arange(n, dtype=torch.float64).reshape(shape) * (i + 1) % 97
                cases.append(base.to(dtype) if dtype != torch.bool else (base.to(torch.int64) % 2).bool())
        big = torch.arange(6 * 8, dtype=torch.float32).reshape(6, 8)
        cases.append(big.t())          # a transposed view
        cases.append(big[::2, 1::3])   # a strided view
        for direction in (0, 1):
            sender = direction
            for k, ref in enumerate(cases):
                if rank == sender:
                    dist.send(ref, dst=1 - sender, tag=k)
                else:
                    # Into a contiguous tensor (the isend / irecv below receive into views).
                    target = torch.zeros_like(ref, memory_format=torch.contiguous_format)
                    dist.recv(target, src=sender, tag=k)
                    expect_equal(f"message {k} from {sender}", target, ref)
            # isend / irecv, posted all at once, received into transposed views.
            refs = [torch.full((4, 5), float(k + 10 * direction)) + torch.arange(5.0) for k in range(8)]
            if rank == sender:
                works = [dist.isend(r, dst=1 - sender, tag=1000 + k) for k, r in enumerate(refs)]
            else:
                holders = [torch.zeros(5, 4) for _ in refs]
                targets = [h.t() for h in holders]  # non-contiguous (4, 5) views
                works = [dist.irecv(t, src=sender, tag=1000 + k) for k, t in enumerate(targets)]
            for w in works:
                wait(w)
            if rank != sender:
                for k, (t, r) in enumerate(zip(targets, refs)):
                    expect_equal(f"irecv {k}", t, r)
        dist.barrier()

    elif scenario == "async_collectives":
        # Programs that work over gloo because its collectives run on its own threads: rank 0
        # starts an all_reduce, sends what rank 1 receives before its all_reduce, then receives
        # what rank 1 sends only after it; a future completes with nobody calling wait().
        t = torch.full((1000,), float(rank + 1))
        m = torch.arange(50000, dtype=torch.int32)
        if rank == 0:
            w = dist.all_reduce(t, async_op=True)
            dist.send(m, dst=1)
            back = torch.zeros(3, dtype=torch.int64)
            dist.recv(back, src=1)
            expect_equal("the message sent after the all_reduce", back, torch.tensor([7, 8, 9]))
            wait(w)
        else:
            got = torch.zeros_like(m)
            dist.recv(got, src=0)
            expect_equal("the message sent before the all_reduce", got, m)
            dist.all_reduce(t)
            dist.send(torch.tensor([7, 8, 9]), dst=0)
        expect_equal("all_reduce around point-to-point", t, torch.full((1000,), 3.0))
        f = dist.all_reduce(t, async_op=True).get_future()
        expect_equal("a future's value", f.wait()[0], torch.full((1000,), 6.0))

        # The future of a Work asked for after wait() (DDP hooks, collect_all over waited works):
        # it completes with the result. Polled with a deadline: a future that never completes is a
        # failure, not a hang.
        def completed(fut, what):
            give_up = time.monotonic() + 10
            while not fut.done():
                if time.monotonic() > give_up:
                    raise AssertionError(f"rank {rank}: {what} never completed")
                time.sleep(0.001)
            return fut

        def late_future(work, what):
            wait(work)
            return completed(work.get_future(), f"the future of a waited {what}").wait()

        t = torch.full((4,), float(rank + 1))
        got = late_future(dist.all_reduce(t, async_op=True), "all_reduce")
        expect_equal("a late future's all_reduce", got[0], torch.full((4,), 3.0))
        b = torch.full((4,), float(rank))
        got = late_future(dist.broadcast(b, src=1, async_op=True), "broadcast")
        expect_equal("a late future's broadcast", got[0], torch.full((4,), 1.0))
        outs = [torch.zeros(2) for _ in range(world)]
        late_future(dist.all_gather(outs, torch.full((2,), float(rank)), async_op=True), "all_gather")
        expect_equal("a late future's all_gather", torch.stack(outs), torch.tensor([[0.0, 0.0], [1.0, 1.0]]))
        late_future(dist.barrier(async_op=True), "barrier")
        chained = dist.all_reduce(t, async_op=True)
        wait(chained)
        then = completed(chained.get_future().then(lambda fut: fut.value()[0] * 2),
                         "then() on a waited all_reduce's future")
        expect_equal("then() after wait()", then.wait(), torch.full((4,), 12.0))
        r = torch.full((3,), float(rank + 1))
        late_future(dist.reduce(r, dst=0, async_op=True), "reduce")
        if rank == 0:
            expect_equal("a late future's reduce", r, torch.full((3,), 3.0))
        g = [torch.zeros(2) for _ in range(world)] if rank == 0 else None
        late_future(dist.gather(torch.full((2,), float(rank)), g, dst=0, async_op=True), "gather")
        if rank == 0:
            expect_equal("a late future's gather", torch.stack(g), torch.tensor([[0.0, 0.0], [1.0, 1.0]]))
        sc = torch.zeros(2)
        late_future(dist.scatter(sc, [torch.full((2,), 5.0), torch.full((2,), 6.0)] if rank == 0 else None, src=0,
                                 async_op=True), "scatter")
        expect_equal("a late future's scatter", sc, torch.full((2,), 5.0 + rank))
        a2a = torch.zeros(2)
        late_future(dist.all_to_all_single(a2a, torch.tensor([10.0 * rank, 10.0 * rank + 1]), async_op=True),
                    "all_to_all_single")
        expect_equal("a late future's all_to_all_single", a2a, torch.tensor([0.0 + rank, 10.0 + rank]))
        # A collective that failed (the ranks disagree on its size): its late future holds the
        # error. Last: every later collective of the group fails with it.
        bad = dist.all_reduce(torch.zeros(4 + rank), async_op=True)
        try:
            bad.wait()
            raise AssertionError(f"rank {rank}: an all_reduce of mismatched sizes succeeded")
        except RuntimeError:
            pass
        fut = completed(bad.get_future(), "the future of a failed, waited all_reduce")
        try:
            fut.wait()
            raise AssertionError(f"rank {rank}: the future of a failed all_reduce has no error")
        except RuntimeError:
            pass
    elif scenario == "collectives":
        for root in range(world):
            for dtype in (torch.float32, torch.int64, torch.uint8):
                ref = (torch.arange(12) + root).reshape(3, 4).to(dtype)
                t = ref.clone() if rank == root else torch.zeros(3, 4, dtype=dtype)
                dist.broadcast(t, src=root)
                expect_equal(f"broadcast from {root}", t, ref)
        wait(dist.broadcast(torch.ones(2) if rank == 0 else torch.zeros(2), src=0, async_op=True))
        dist.barrier()
        # The other collectives, checked against values computed here for every rank.
        n = 1000 + 7  # odd, and several window steps of the small window below for float64
        mine = lambda r: (torch.arange(n, dtype=torch.float64) * (r + 1) + r).to(torch.float32)
        t = mine(rank)
        dist.all_reduce(t)
        expect_equal("all_reduce SUM", t, sum(mine(r) for r in range(world)))
        t = torch.tensor([rank * 10 + 1, 7 - rank], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        expect_equal("all_reduce MAX", t, torch.tensor([(world - 1) * 10 + 1, 7]))
        t = torch.tensor([float(rank)] * 5)
        wait(dist.all_reduce(t, op=dist.ReduceOp.MIN, async_op=True))
        expect_equal("all_reduce MIN async", t, torch.zeros(5))
        # Floating-point sums are bit-identical on every rank.
        x = torch.rand(4099, generator=torch.Generator().manual_seed(rank)) * 1e3
        dist.all_reduce(x)
        outs = [torch.empty_like(x) for _ in range(world)]
        dist.all_gather(outs, x)
        for r in range(world):
            if not torch.equal(outs[r].view(torch.int32), x.view(torch.int32)):
                raise AssertionError(f"all_reduce result of rank {r} differs from rank {rank}'s")
        t = mine(rank)
        dist.reduce(t, dst=world - 1)
        expect_equal("reduce", t, sum(mine(r) for r in range(world)) if rank == world - 1 else mine(rank))
        outs = [torch.empty(n) for _ in range(world)]
        dist.all_gather(outs, mine(rank))
        for r in range(world):
            expect_equal(f"all_gather from {r}", outs[r], mine(r))
        gathered = [None] * world
        dist.all_gather_object(gathered, {"rank": rank, "name": "r" * rank})
        if gathered != [{"rank": r, "name": "r" * r} for r in range(world)]:
            raise AssertionError(f"all_gather_object: {gathered}")
        last = world - 1
        outs = [torch.empty(n) for _ in range(world)] if rank == last else None
        dist.gather(mine(rank), gather_list=outs, dst=last)
        if rank == last:
            for r in range(world):
                expect_equal(f"gather from {r}", outs[r], mine(r))
        t = torch.empty(3, dtype=torch.int32)
        dist.scatter(t, [torch.full((3,), 100 + r, dtype=torch.int32) for r in range(world)] if rank == 0 else None, src=0)
        expect_equal("scatter", t, torch.full((3,), 100 + rank, dtype=torch.int32))
        t = torch.empty(4)
        dist.reduce_scatter(t, [torch.full((4,), float(rank * world + d)) for d in range(world)])
        expect_equal("reduce_scatter", t, torch.full((4,), float(sum(r * world + rank for r in range(world)))))
        # The tensor forms: one buffer of world blocks (c10d's _reduce_scatter_base, _allgather_base).
        t = torch.empty(5, dtype=torch.int64)
        dist.reduce_scatter_tensor(t, torch.arange(world * 5, dtype=torch.int64) * (rank + 1), op=dist.ReduceOp.SUM)
        expect_equal("reduce_scatter_tensor", t,
                     torch.arange(rank * 5, rank * 5 + 5, dtype=torch.int64) * sum(r + 1 for r in range(world)))
        big = torch.empty(world, 3)
        dist.all_gather_into_tensor(big, torch.full((3,), float(rank)))
        expect_equal("all_gather_into_tensor", big, torch.arange(world, dtype=torch.float32).repeat_interleave(3).reshape(world, 3))
        send = torch.arange(world * 2, dtype=torch.int64) + 100 * rank
        recv = torch.empty(world * 2, dtype=torch.int64)
        dist.all_to_all_single(recv, send)
        expect_equal("all_to_all_single", recv,
                     torch.tensor([100 * r + 2 * rank + k for r in range(world) for k in range(2)], dtype=torch.int64))
        objs = [{"k": [1, 2, 3]}] if rank == 0 else [None]
        dist.broadcast_object_list(objs, src=0)
        if objs != [{"k": [1, 2, 3]}]:
            raise AssertionError(f"broadcast_object_list: {objs}")
        # A reduce op the dtype does not have is an error that says so; the group works on.
        try:
            dist.all_reduce(torch.ones(3), op=dist.ReduceOp.BAND)
        except Exception as e:  # tdshm.TypeError through pybind11
            if "BAND" not in str(e):
                raise AssertionError(f"unclear error for BAND on float: {e}")
        else:
            raise AssertionError("all_reduce(BAND) on float did not raise")
        dist.barrier()

    elif scenario == "groups":
        # Two subgroups in one run: different segments. Rank 1 is not in the first one.
        first = dist.new_group([0, 2], backend="shm")
        second = dist.new_group([0, 1, 2], backend="shm")
        if rank == 1:
            if first != dist.GroupMember.NON_GROUP_MEMBER:
                raise AssertionError("a non-member got a group")
        else:
            record(first)
            t = torch.tensor([5.0, 6.0]) if rank == 2 else torch.zeros(2)
            dist.broadcast(t, src=2, group=first)
            expect_equal("first subgroup broadcast", t, torch.tensor([5.0, 6.0]))
            if rank == 0:
                dist.send(torch.arange(3), dst=2, group=first)
            else:
                r = torch.zeros(3, dtype=torch.int64)
                dist.recv(r, src=0, group=first)
                expect_equal("first subgroup recv", r, torch.arange(3))
        record(second)
        if not (first == dist.GroupMember.NON_GROUP_MEMBER or first.segment_name != second.segment_name):
            raise AssertionError("two groups share a segment")
        dist.barrier(group=second)
        t = torch.tensor([rank])
        if rank == 1:
            dist.send(t, dst=0, group=second)
        elif rank == 0:
            dist.recv(t, src=1, group=second)
            expect_equal("second subgroup recv", t, torch.tensor([1]))
        dist.barrier()

    elif scenario == "loans":
        # Rank 1 loans a batch (tdshm.empty, tdshm.loan of a dict), fills it and sends it three
        # ways: dist.isend (rank 0 takes a view: the send completes only once it is dropped),
        # dist.send (rank 0 copies it with dist.recv), a Transfer of the dict (rank 0's
        # Transfer.recv_view gives views of every leaf).
        pg = default_pg
        batch = {"image": torch.zeros(4, 3, 8, 8, dtype=torch.uint8), "meta": {"idx": torch.zeros(4, dtype=torch.int64)}}
        if rank == 1:
            t = tdshm.empty((6, 5), dtype=torch.float64, dst=0)
            if not pg.is_loan(t) or not pg.is_loan(t[1:3]):
                raise AssertionError("tdshm.empty gave no loan")
            t.copy_(torch.arange(30, dtype=torch.float64).reshape(6, 5))
            work = dist.isend(t, dst=0, tag=3)
            dist.barrier()  # rank 0 holds its view now, and keeps it until the next barrier
            if work.is_completed():
                raise AssertionError("a loan's send completed while its view was held")
            dist.barrier()
            wait(work)  # completes once rank 0 dropped its view
            dist.send(t, dst=0, tag=4)
            lent = tdshm.loan(batch, dst=0)
            lent["image"].copy_(torch.arange(4 * 3 * 8 * 8).remainder(251).to(torch.uint8).reshape(4, 3, 8, 8))
            lent["meta"]["idx"].copy_(torch.arange(4) * 7)
            tdshm.Transfer(lent).send(0)
            try:
                tdshm.empty((1 << 30,), dtype=torch.uint8)
            except RuntimeError as e:
                if "loan heap" not in str(e):
                    raise
            else:
                raise AssertionError("a loan larger than the heap was handed out")
        else:
            v = tdshm.recv_view(1, tag=3)
            expect_equal("view of a loan", v, torch.arange(30, dtype=torch.float64).reshape(6, 5))
            dist.barrier()
            dist.barrier()
            del v
            mine = torch.zeros(6, 5, dtype=torch.float64)
            dist.recv(mine, src=1, tag=4)
            expect_equal("copy of a loan", mine, torch.arange(30, dtype=torch.float64).reshape(6, 5))
            views = tdshm.Transfer(batch).recv_view(1)
            expect_equal("image view", views["image"], torch.arange(4 * 3 * 8 * 8).remainder(251).to(torch.uint8).reshape(4, 3, 8, 8))
            expect_equal("meta.idx view", views["meta"]["idx"], torch.arange(4) * 7)
            if batch["meta"]["idx"].any():
                raise AssertionError("recv_view wrote into its template")
            # Given back now (rank 1's blocking send returns), though `views` is still referenced.
            if tdshm.release(views) != 2 or tdshm.release(views) != 0 or tdshm.release(torch.zeros(2)) != 0:
                raise AssertionError("tdshm.release gave back the wrong number of loans")
        dist.barrier()

    else:
        raise AssertionError(f"unknown scenario {scenario}")
    dist.destroy_process_group()


# ---------------------------------------------------------------------------------------------
# Test side


def _free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _store_segments():
    try:
        return {n for n in os.listdir("/dev/shm") if n.startswith("tdshm.pg-")}
    except FileNotFoundError:
        return set()


def _creator_pid(name):
    """The pid in a store segment's name, "tdshm.pg-<pid>-<hex>[.lock]" (None if it has none)."""
    pid = name[len("tdshm.pg-"):].split("-", 1)[0]
    return int(pid) if pid.isdigit() else None


class ShmBackendTest(unittest.TestCase):
    def setUp(self):
        self.dir = tempfile.TemporaryDirectory(prefix="tdshm_py_")
        self.addCleanup(self.dir.cleanup)
        self.before = _store_segments()

    def run_world(self, scenario, world, method):
        outdir = tempfile.mkdtemp(dir=self.dir.name)
        if method == "file":
            init_method = "file://" + os.path.join(outdir, "store")
        else:
            init_method = f"tcp://127.0.0.1:{_free_port()}"
        logs = [os.path.join(outdir, f"rank{r}.log") for r in range(world)]
        pids = [forked.start(_worker, (scenario, r, world, init_method, outdir), logs[r]) for r in range(world)]
        codes, killed = forked.wait_all(pids, WORLD_DEADLINE)
        failed = []
        for r, code in enumerate(codes):
            if code != 0:
                with open(logs[r], errors="replace") as f:
                    out = f.read()
                failed.append((r, code, out + ("\n[killed: the world overstayed its deadline]" if killed else "")))
        self.assertFalse(failed, "\n".join(f"rank {r} exited with {code}:\n{out}" for r, code, out in failed))
        segments = set()
        for r in range(world):
            path = os.path.join(outdir, f"segments.{r}")
            if os.path.exists(path):
                with open(path) as f:
                    segments.update(line.strip() for line in f if line.strip())
        # Nothing left in /dev/shm: the segments of this world, their lock files, any new one.
        for name in segments:
            for leftover in (f"/dev/shm/tdshm.{name}", f"/dev/shm/tdshm.{name}.lock"):
                self.assertFalse(os.path.exists(leftover), f"{leftover} was left behind")
        # (Only this world's: a test running beside this one may have groups of its own.)
        mine = {n for n in _store_segments() - self.before if _creator_pid(n) in pids}
        self.assertEqual(mine, set(), "new tdshm.pg-* segments were left behind")
        return segments

    def test_p2p_file(self):
        self.run_world("p2p", 2, "file")

    def test_p2p_tcp(self):
        self.run_world("p2p", 2, "tcp")

    def test_loans(self):
        self.run_world("loans", 2, "file")

    def test_collectives(self):
        self.run_world("collectives", 3, "file")

    def test_async_collectives(self):
        self.run_world("async_collectives", 2, "file")

    def test_groups_file(self):
        segments = self.run_world("groups", 3, "file")
        # The default group and two subgroups: three different segments.
        self.assertEqual(len(segments), 3, segments)

    def test_groups_tcp(self):
        segments = self.run_world("groups", 3, "tcp")
        self.assertEqual(len(segments), 3, segments)

    def test_two_runs_get_different_segments(self):
        first = self.run_world("collectives", 2, "file")
        second = self.run_world("collectives", 2, "file")
        self.assertFalse(first & second, (first, second))

    def test_module(self):
        import torch.distributed as dist

        import tdshm

        self.assertIsInstance(tdshm.__version__, str)
        self.assertIn("SHM", dist.Backend._plugins)
        self.assertTrue(issubclass(tdshm.ProcessGroupShm, dist.ProcessGroup))
        # A group made directly on a named segment (a world of one).
        name = f"pytest-{os.getpid()}-direct"
        pg = tdshm.ProcessGroupShm(name, 0, 1, timeout=timedelta(seconds=5))
        self.assertEqual((pg.rank(), pg.size(), pg.segment_name), (0, 1, name))
        self.assertTrue(os.path.exists(f"/dev/shm/tdshm.{name}"))
        del pg
        self.assertFalse(os.path.exists(f"/dev/shm/tdshm.{name}"))
        with self.assertRaises(RuntimeError):
            tdshm.ProcessGroupShm("a b", 0, 1)  # invalid segment name


if __name__ == "__main__":
    unittest.main()
