"""tdshm.DataLoader against torch.utils.data.DataLoader as the oracle.

Every test builds the same loader twice (torch's and tdshm's: same dataset, sampler and generator
seed) and checks that they yield the same batches in the same order, or fail the same way; then
that no tdshm.dl-* segment is left in /dev/shm. Failures: an exception in a worker (its type and
the worker's traceback), a worker killed by a signal (a RuntimeError naming its pid and signal
within 1 s), the loader's timeout, main killed (its workers exit), a loop left with break.

Run by ctest (python.loader) with PYTHONPATH=<build>/python.
"""

import collections
import faulthandler
import glob
import mmap
import os
import select
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
import unittest
from datetime import timedelta

os.environ["OMP_NUM_THREADS"] = "1"
import torch  # noqa: E402
from torch.utils.data import DataLoader as TorchLoader  # noqa: E402
from torch.utils.data import Dataset, IterableDataset, get_worker_info  # noqa: E402

import tdshm  # noqa: E402
from tdshm._C import AnswerCodec, LeafIds, TaskRing  # noqa: E402

try:
    import numpy
except ImportError:  # torch runs without it; its conversions are then not tested
    numpy = None

Pair = collections.namedtuple("Pair", ["left", "right"])


def running(pid):
    """Whether process `pid` exists and is not a zombie."""
    try:
        with open("/proc/{}/stat".format(pid)) as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def segments():
    return set(glob.glob("/dev/shm/tdshm.dl-{}-*".format(os.getpid())))


class Samples(Dataset):
    """Every kind of value a sample may hold: tensors of several dtypes, ints, floats, strings,
    tuples, lists, namedtuples, nested dicts; and what a worker sees (its info and seed)."""

    def __init__(self, n=37):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        info = get_worker_info()
        sample = {
            "image": torch.full((3, 8, 8), i % 256, dtype=torch.uint8),
            "x": torch.arange(5, dtype=torch.float32) * i,
            "label": i,
            "weight": i / 2.0,
            "name": "sample-{}".format(i),
            "pair": Pair(torch.tensor([i, -i]), i * 3),
            "nested": {"t": (torch.ones(2, dtype=torch.int64) * i, [i, i + 1])},
            "flag": torch.tensor(i % 2 == 0),
            "seed": torch.initial_seed(),
            "worker": -1 if info is None else info.id,
            "info": None if info is None else (info.num_workers, info.seed, type(info.dataset).__name__),
            "random": torch.rand(2),
        }
        if numpy is not None:  # default_convert / default_collate turn these into tensors
            sample["array"] = numpy.arange(3) * i
            sample["scalar"] = numpy.float64(i) / 4
        return sample


class Ranges(IterableDataset):
    """Each worker yields its share of [0, n), unevenly (one worker has more)."""

    def __init__(self, n=23):
        self.n = n

    def __iter__(self):
        info = get_worker_info()
        lo, hi = 0, self.n
        if info is not None:
            per = (self.n + info.num_workers - 1) // info.num_workers
            lo, hi = info.id * per, min(self.n, (info.id + 1) * per)
        for i in range(lo, hi):
            yield {"i": torch.tensor(i), "v": torch.full((4,), float(i)), "w": info.id if info else -1}


class Whole(Dataset):
    """Whole batches (batch_size=None)."""

    def __len__(self):
        return 12

    def __getitem__(self, i):
        return {"image": torch.full((4, 3, 16, 16), i, dtype=torch.uint8), "label": torch.arange(4) + 4 * i}


class Images(Dataset):
    """Per-sample images whose batches of 32 (393 KB) outgrow a worker's first heap."""

    def __len__(self):
        return 1000

    def __getitem__(self, i):
        return {"image": torch.full((3, 64, 64), i % 256, dtype=torch.uint8), "label": i}


class SmallLeaves(Dataset):
    """Samples of `leaves` float32 tensors of 256 values (1 KiB each) in a dict."""

    def __init__(self, leaves):
        self.leaves = leaves

    def __len__(self):
        return 16

    def __getitem__(self, i):
        return {"f{}".format(j): torch.full((256,), float(i * 100 + j)) for j in range(self.leaves)}


class Big(Dataset):
    """Items of 256 KiB made in the worker (they lie in its heap and go by reference); every
    fourth comes from a cache the worker keeps and returns again each epoch."""

    def __init__(self, n=40):
        self.n = n
        self.cache = {}

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if i % 4:
            return {"x": torch.full((64 << 10,), float(i)), "i": i}
        if i not in self.cache:
            self.cache[i] = torch.full((64 << 10,), float(i))
        return {"x": self.cache[i], "i": i}


class Raises(Dataset):
    def __len__(self):
        return 16

    def __getitem__(self, i):
        if i == 9:
            raise KeyError("no sample 9 here")
        return torch.tensor([i])


class Kills(Dataset):
    """Index 20 kills its worker, which first writes the time and its pid to `path`."""

    def __init__(self, path):
        self.path = path

    def __len__(self):
        return 64

    def __getitem__(self, i):
        if i == 20:
            with open(self.path, "w") as f:
                f.write("{} {}".format(time.monotonic(), os.getpid()))
            os.kill(os.getpid(), signal.SIGKILL)
        return torch.tensor([i])


class Slow(Dataset):
    def __len__(self):
        return 4

    def __getitem__(self, i):
        if i == 2:
            time.sleep(3)
        return torch.tensor([i])


class Trees(Dataset):
    """Plain trees as whole items (batch_size=None): what the workers' AnswerCodec writes itself
    (tuples, lists, dicts of scalars, bytes, None, a list twice), and what it leaves to pickle (an
    int past 64 bits, a dict subclass, a list that holds itself)."""

    def __len__(self):
        return 12

    def __getitem__(self, i):
        shared = [i, "x"]
        kind = i % 4
        if kind == 0:
            return {"t": (torch.tensor(i), "s", b"b", None, True, 2.5 * i), "l": [shared, shared],
                    "k": {1: "one", None: i, 2.5: False, b"x": (i,)}}
        if kind == 1:
            return (torch.arange(i), [(), (i, -i)], -2 ** 63, "\u00e9\u4e2d", float("-inf"))
        if kind == 2:
            return {"big": 2 ** 70 + i, "x": torch.ones(2) * i,
                    "ordered": collections.OrderedDict(a=torch.zeros(i % 3))}
        looped = [i]
        looped.append(looped)
        return [torch.zeros(i % 3, 2), {"self": looped}]


class Grads(Dataset):
    """Tensors that are not plain: a Parameter and a tensor requiring grad."""

    def __len__(self):
        return 4

    def __getitem__(self, i):
        return {"w": torch.nn.Parameter(torch.full((2,), float(i))), "g": torch.arange(3.0).requires_grad_(),
                "x": torch.full((2,), i)}


class Sparse(Dataset):
    def __len__(self):
        return 4

    def __getitem__(self, i):
        return {"s": torch.eye(3).to_sparse() * i, "d": torch.ones(2) * i}


class Unpicklable(Dataset):
    """Item 1 holds a lambda."""

    def __len__(self):
        return 3

    def __getitem__(self, i):
        return {"f": (lambda: i) if i == 1 else i}


class Unconvertible(Dataset):
    """Numpy arrays, item 2 of a dtype torch 1.13 cannot make a tensor of (default_convert fails)."""

    def __len__(self):
        return 4

    def __getitem__(self, i):
        return {"a": numpy.arange(3, dtype=numpy.uint16 if i == 2 else numpy.int64) + i}


def as_is(item):
    return item


def custom_collate(batch):
    return {"sum": sum(b["x"] for b in batch), "names": [b["name"] for b in batch], "n": len(batch)}


def same(a, b, where="batch"):
    """Raises AssertionError naming where `a` and `b` differ (tensors: dtype, shape, values)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            raise AssertionError("{}: {} against {}".format(where, type(a), type(b)))
        if a.dtype != b.dtype or a.shape != b.shape or not torch.equal(a, b):
            raise AssertionError("{}: {} against {}".format(where, a, b))
        return
    if type(a) is not type(b):
        raise AssertionError("{}: {} against {}".format(where, type(a).__name__, type(b).__name__))
    if isinstance(a, dict):
        if list(a.keys()) != list(b.keys()):
            raise AssertionError("{}: keys {} against {}".format(where, list(a), list(b)))
        for k in a:
            same(a[k], b[k], "{}[{!r}]".format(where, k))
    elif isinstance(a, (list, tuple)):
        if len(a) != len(b):
            raise AssertionError("{}: {} items against {}".format(where, len(a), len(b)))
        for k, (x, y) in enumerate(zip(a, b)):
            same(x, y, "{}[{}]".format(where, k))
    elif a != b:
        raise AssertionError("{}: {!r} against {!r}".format(where, a, b))


class LoaderTest(unittest.TestCase):
    def setUp(self):
        self.before = segments()

    def tearDown(self):
        deadline = time.monotonic() + 5
        while segments() - self.before and time.monotonic() < deadline:
            time.sleep(0.05)
        self.assertEqual(segments() - self.before, set(), "segments left in /dev/shm")

    def both(self, dataset, seed=1234, **kwargs):
        """The two loaders' batches, each built with a generator seeded `seed`."""
        out = []
        for cls in (TorchLoader, tdshm.DataLoader):
            loader = cls(dataset, generator=torch.Generator().manual_seed(seed), **kwargs)
            out.append((len(loader) if not isinstance(dataset, IterableDataset) else None, list(loader)))
            del loader
        return out

    def check_same(self, dataset, **kwargs):
        (n_torch, torch_batches), (n_shm, shm_batches) = self.both(dataset, **kwargs)
        self.assertEqual(n_torch, n_shm)
        self.assertEqual(len(torch_batches), len(shm_batches))
        self.assertGreater(len(shm_batches), 0)
        for i, (a, b) in enumerate(zip(torch_batches, shm_batches)):
            same(a, b, "batch {}".format(i))
        return shm_batches

    def test_map_style_every_value_kind(self):
        for workers in (1, 2, 3):
            for drop_last in (False, True):
                with self.subTest(workers=workers, drop_last=drop_last):
                    self.check_same(Samples(), batch_size=4, shuffle=True, num_workers=workers, drop_last=drop_last)

    def test_samplers_and_prefetch(self):
        ds = Samples(20)
        self.check_same(ds, batch_size=3, sampler=list(reversed(range(20))), num_workers=2, prefetch_factor=1)
        self.check_same(ds, batch_sampler=[[1, 2], [7], [3, 4, 5], [19, 0]], num_workers=2, prefetch_factor=3)
        self.check_same(ds, batch_size=None, num_workers=2)  # one sample at a time, not collated
        # Tasks of 40,000 indices each: main's messages outgrow the pipe's buffer and a worker's
        # read, and arrive in pieces.
        self.check_same(range(7), batch_sampler=[[i % 7 for i in range(k, k + 40000)] for k in range(5)],
                        num_workers=2)
        # Tasks that fit a ring slot and tasks that do not (those go through the pipe), mixed:
        # each worker still reads them in the order main sent them.
        mixed = [[k % 7] if k % 3 else [i % 7 for i in range(k, k + 3000)] for k in range(12)]
        self.check_same(range(7), batch_sampler=mixed, num_workers=2, prefetch_factor=3)
        # Indices that are no int of 64 bits (keys of a dict, a huge int, a bool) are pickled.
        table = {"a": torch.ones(2), 2 ** 70: torch.zeros(3), True: torch.arange(4), 5: torch.full((2,), 5)}
        self.check_same(table, sampler=["a", 2 ** 70, True, 5, "a", 5], batch_size=None, num_workers=2)

    def test_iterable_dataset(self):
        for workers in (2, 3):
            with self.subTest(workers=workers):
                self.check_same(Ranges(), batch_size=3, num_workers=workers)
                self.check_same(Ranges(), batch_size=3, num_workers=workers, drop_last=True)

    def test_whole_batches_and_custom_collate(self):
        batches = self.check_same(Whole(), batch_size=None, num_workers=3)
        self.assertEqual(batches[5]["image"].shape, (4, 3, 16, 16))
        self.check_same(Samples(), batch_size=5, num_workers=2, collate_fn=custom_collate)

    def test_plain_trees_with_and_without_default_convert(self):
        # batch_size=None: torch's default_convert makes each item the batch (a tuple becomes a
        # list, a list met twice two lists); with a collate_fn of its own an item stays as it is
        # (a tuple, one list twice). Items with a self-holding list are compared by hand.
        plain = [i for i in range(12) if i % 4 != 3]
        converted = self.check_same(Trees(), sampler=plain, batch_size=None, num_workers=2)
        self.assertIsNot(converted[0]["l"][0], converted[0]["l"][1])
        kept = self.check_same(Trees(), sampler=plain, batch_size=None, num_workers=2, collate_fn=as_is)
        self.assertIs(kept[0]["l"][0], kept[0]["l"][1])
        self.assertIs(type(kept[1]), tuple)
        looped = list(tdshm.DataLoader(Trees(), sampler=[3, 7], batch_size=None, num_workers=2, collate_fn=as_is))
        for i, item in zip((3, 7), looped):
            inner = item[1]["self"]
            self.assertEqual(inner[0], i)
            self.assertIs(inner[1], inner)
            same(item[0], torch.zeros(i % 3, 2), "item {}".format(i))

    def test_tensors_the_workers_make_travel_by_reference(self):
        # Big items (and cached ones, returned again) kept by the hundred, over epochs, against
        # torch's loader; then a stream whose views go back as they are dropped.
        self.check_same(Big(), batch_size=None, num_workers=2)
        self.check_same(Big(), batch_size=2, shuffle=True, num_workers=3)
        loader = tdshm.DataLoader(Big(), batch_size=None, num_workers=2, persistent_workers=True)
        for epoch in range(3):
            kept = list(loader)
            for i, b in enumerate(kept):
                same(b, Big()[i], "epoch {} item {}".format(epoch, i))
        del kept, b  # the heaps are free again: every item of the stream is a view
        for i, b in enumerate(loader):
            same(b, Big()[i], "streamed item {}".format(i))
            self.assertTrue(tdshm._C._release_view(b["x"]), "item {} is a view of the worker's heap".format(i))
        del loader

    def test_spawned_workers(self):
        # multiprocessing_context="spawn": workers that import everything afresh (the dataset and
        # the loader's worker pickled), Big's tensors made in their heaps.
        self.check_same(Samples(), batch_size=4, shuffle=True, num_workers=2, multiprocessing_context="spawn")
        self.check_same(Big(12), batch_size=None, num_workers=2, multiprocessing_context="spawn")

    def test_a_long_step_in_main_keeps_the_workers(self):
        # Main busy for longer than a worker's check that it runs (0.5 s) between two batches,
        # with every start method: a forkserver's workers are the fork server's children, and
        # took main for gone when they looked at their parent pid.
        for method in ("fork", "spawn", "forkserver"):
            with self.subTest(method=method):
                loader = tdshm.DataLoader(Samples(), batch_size=4, num_workers=2, multiprocessing_context=method)
                got = []
                for i, batch in enumerate(loader):
                    got.append(batch)
                    if i in (1, 2):
                        time.sleep(1.2)
                self.assertEqual(len(got), len(loader))
                labels = torch.cat([batch["label"] for batch in got])
                self.assertTrue(torch.equal(labels, torch.arange(len(Samples()))), labels)
                del loader, got

    def test_a_profiler_sees_each_batch(self):
        # torch's iterator records each batch for a profiler; ours does too while one runs (and
        # skips the record otherwise).
        loader = tdshm.DataLoader(Whole(), batch_size=None, num_workers=2)
        with torch.autograd.profiler.profile() as prof:
            batches = list(loader)
        self.assertEqual(len(batches), len(Whole()))
        names = [e.name for e in prof.function_events]
        self.assertGreaterEqual(sum(1 for n in names if n.startswith("enumerate(DataLoader)#_ShmLoaderIter")),
                                len(batches), names)
        for i, b in enumerate(batches):
            same(b, Whole()[i], "batch {}".format(i))
        del loader

    def test_worker_init_fn_and_epochs(self):
        seen = []

        def init(worker_id):
            info = get_worker_info()
            assert info.id == worker_id and info.num_workers == 2 and info.seed == torch.initial_seed()

        for persistent in (False, True):
            with self.subTest(persistent=persistent):
                loaders = [cls(Samples(13), batch_size=4, shuffle=True, num_workers=2, worker_init_fn=init,
                               persistent_workers=persistent, generator=torch.Generator().manual_seed(7))
                           for cls in (TorchLoader, tdshm.DataLoader)]
                for epoch in range(3):
                    a, b = list(loaders[0]), list(loaders[1])
                    self.assertEqual(len(b), len(loaders[1]))
                    for i, (x, y) in enumerate(zip(a, b)):
                        same(x, y, "epoch {} batch {}".format(epoch, i))
                    seen.append(len(b))
                del loaders
        self.assertEqual(seen, [4] * 6)

    def test_batches_live_as_long_as_the_user_keeps_them(self):
        # Many batches kept at once (more than any heap holds), then a loop that keeps every
        # other batch past the next step, then break mid-epoch.
        loader = tdshm.DataLoader(Whole(), batch_size=None, num_workers=2)
        for _ in range(3):
            kept = list(loader)
            for i, b in enumerate(kept):
                same(b, Whole()[i], "kept batch {}".format(i))
        held = []
        for i, b in enumerate(loader):
            if i % 2 == 0:
                held.append((i, b))
        for i, b in held:
            same(b, Whole()[i], "held batch {}".format(i))
        for i, b in enumerate(loader):
            if i == 3:
                break
        del loader, held, kept

    def test_kept_batches_of_many_small_tensors(self):
        # A batch of 20 small tensors (64-128 KiB in all) travels inside its frame, which the
        # worker made in its heap: sent by reference, the put waited for main to drop it, and
        # list(loader) hung forever. Batches of 12 to 64 such tensors, kept and dropped.
        for leaves in (12, 16, 20, 31, 64):
            self.check_same(SmallLeaves(leaves), batch_size=4, num_workers=2)
            self.check_same(SmallLeaves(leaves), batch_size=None, num_workers=1)

    def test_a_consumer_slower_than_a_rendezvous(self):
        # Worker 1's first answer waits for main to attach to its group, in slices of 2 s: a user
        # step of 2.5 s after the first batch spans more than one.
        want = list(TorchLoader(Samples(12), batch_size=3, num_workers=2, generator=torch.Generator().manual_seed(5)))
        got = []
        for i, b in enumerate(tdshm.DataLoader(Samples(12), batch_size=3, num_workers=2,
                                               generator=torch.Generator().manual_seed(5))):
            got.append(b)
            if i == 0:
                time.sleep(2.5)
        self.assertEqual(len(got), len(want))
        for i, (a, b) in enumerate(zip(want, got)):
            same(a, b, "batch {}".format(i))

    def test_an_exception_in_a_worker_is_raised_in_main(self):
        for cls in (TorchLoader, tdshm.DataLoader):
            with self.subTest(loader=cls.__module__):
                loader = cls(Raises(), batch_size=2, num_workers=2)
                got = []
                with self.assertRaises(KeyError) as caught:
                    for b in loader:
                        got.append(b)
                self.assertIn("in DataLoader worker process", str(caught.exception))
                self.assertIn("no sample 9 here", str(caught.exception))
                self.assertIn("Traceback", str(caught.exception))
                self.assertEqual(len(got), 4)  # batches 0-3; batch 4 holds index 9
                del loader

    def test_tensors_that_are_not_plain_arrive_as_torchs_do(self):
        # Parameters and tensors requiring grad keep their type and flag (pickled, their data by
        # the feed), as with torch's DataLoader.
        (_, torch_items), (_, shm_items) = self.both(Grads(), batch_size=None, num_workers=2)
        self.assertEqual(len(shm_items), 4)
        for i, (a, b) in enumerate(zip(torch_items, shm_items)):
            same(a, b, "item {}".format(i))
            for key in a:
                self.assertIs(type(b[key]), type(a[key]), key)
                self.assertEqual(b[key].requires_grad, a[key].requires_grad, key)
        self.assertIs(type(shm_items[1]["w"]), torch.nn.Parameter)
        self.assertTrue(shm_items[1]["g"].requires_grad)

    def test_sparse_tensors_travel_where_torchs_loader_hangs(self):
        # torch 1.13's DataLoader hangs on a sparse tensor (its queue's feeder thread cannot
        # pickle it); tdshm pickles it, its indices and values by the feed.
        out = list(tdshm.DataLoader(Sparse(), batch_size=None, num_workers=2))
        self.assertEqual(len(out), 4)
        for i, item in enumerate(out):
            self.assertTrue(item["s"].is_sparse)
            same(item["s"].to_dense(), torch.eye(3) * i, "item {}".format(i))
            same(item["d"], torch.ones(2) * i, "item {}".format(i))

    def test_a_batch_that_cannot_travel_is_the_workers_error(self):
        # An object pickle refuses (a lambda) fails torch's feeder thread, and torch's main then
        # waits forever; tdshm's worker answers with its error, and the next items still come.
        it = iter(tdshm.DataLoader(Unpicklable(), batch_size=None, num_workers=2))
        self.assertEqual(next(it), {"f": 0})
        with self.assertRaises(AttributeError) as caught:
            next(it)
        self.assertIn("in DataLoader worker process 1", str(caught.exception))
        self.assertIn("pickle", str(caught.exception))
        self.assertEqual(next(it), {"f": 2})
        del it

    @unittest.skipIf(numpy is None, "numpy is not installed")
    def test_default_convert_failing_is_the_workers_exception(self):
        # batch_size=None: torch's default_convert runs in torch's fetch, and in tdshm's worker
        # as it writes the answer; an array torch cannot convert fails the same way in both, and
        # the next items still come.
        for cls in (TorchLoader, tdshm.DataLoader):
            with self.subTest(loader=cls.__module__):
                it = iter(cls(Unconvertible(), batch_size=None, num_workers=2))
                same(next(it), {"a": torch.arange(3)}, "item 0")
                same(next(it), {"a": torch.arange(3) + 1}, "item 1")
                with self.assertRaises(TypeError) as caught:
                    next(it)
                self.assertIn("in DataLoader worker process 0", str(caught.exception))
                same(next(it), {"a": torch.arange(3) + 3}, "item 3")
                del it

    def test_a_killed_worker_is_a_runtime_error_naming_it(self):
        import tempfile
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "killed")
            loader = tdshm.DataLoader(Kills(path), batch_size=2, num_workers=2)
            got = []
            with self.assertRaises(RuntimeError) as caught:
                for b in loader:
                    got.append(b)
            raised = time.monotonic()
            killed, pid = open(path).read().split()
            message = str(caught.exception)
            self.assertIn(pid, message)
            self.assertTrue("killed by signal: Killed" in message or "exited unexpectedly" in message, message)
            self.assertLess(raised - float(killed), 1.0, message)
            # The batches before the killed one, in order: as with torch's loader, the error may come
            # while main waits for the other worker's batch (torch's SIGCHLD handler raises at once),
            # so main has the batches before index 20 or the first of them, never a gap or a later one.
            firsts = [int(b[0]) for b in got]
            self.assertEqual(firsts, list(range(0, 2 * len(firsts), 2)))
            self.assertLessEqual(len(firsts), 10)
            del loader

    def test_timeout(self):
        loader = tdshm.DataLoader(Slow(), batch_size=1, num_workers=2, timeout=1)
        with self.assertRaises(RuntimeError) as caught:
            list(loader)
        self.assertIn("DataLoader timed out after 1 seconds", str(caught.exception))
        del loader

    def test_a_timeout_comes_on_time_and_ends_the_iterator_plainly(self):
        # The error came 5 s late (the shutdown waited for the stuck worker); later next() calls
        # said a worker "exited unexpectedly", and a persistent loader's next epoch was dead.
        with tempfile.TemporaryDirectory() as tmp:
            stuck = os.path.join(tmp, "stuck")
            open(stuck, "w").close()

            class Stuck(Dataset):
                def __len__(self):
                    return 6

                def __getitem__(self, i):
                    while i == 2 and os.path.exists(stuck):
                        time.sleep(0.05)
                    return torch.tensor([i])

            for persistent in (False, True):
                open(stuck, "w").close()
                loader = tdshm.DataLoader(Stuck(), batch_size=1, num_workers=1, timeout=1,
                                          persistent_workers=persistent)
                it = iter(loader)
                self.assertEqual([int(next(it)), int(next(it))], [0, 1])
                start = time.monotonic()
                with self.assertRaisesRegex(RuntimeError, "DataLoader timed out after 1 seconds"):
                    next(it)
                self.assertLess(time.monotonic() - start, 2.5, "the timeout came late")
                with self.assertRaisesRegex(RuntimeError, r"iterator has ended \(DataLoader timed out"):
                    next(it)
                os.unlink(stuck)
                self.assertEqual([int(b) for b in loader], list(range(6)), "a new epoch gets new workers")
                del it, loader

    def test_main_killed_ends_its_workers(self):
        # Every start method: spawn and forkserver workers read their tasks from a pipe, which
        # main's exit closes before that exit has ended, and a worker that left its group then
        # left it in /dev/shm (main still counted as alive). Main holds some batches and its
        # workers fill their heaps (8 x 256 KiB batches), as in a training loop.
        script = textwrap.dedent("""
            import os, sys, time, torch, tdshm
            from torch.utils.data import Dataset
            class D(Dataset):
                def __len__(self): return 10**6
                def __getitem__(self, i): return torch.full((64, 128), float(i % 7))
            if __name__ == "__main__":
                it = iter(tdshm.DataLoader(D(), batch_size=8, num_workers=3, multiprocessing_context=sys.argv[1]))
                kept = [b for i, b in zip(range(200), it) if i % 50 == 0]
                print(os.getpid(), *[w.pid for w in it._workers], flush=True)
                time.sleep(60)
        """)
        self._run_with_each_start_method(script, self._kill_main_and_check)

    def _run_with_each_start_method(self, script, check):
        """check(path, method) for a file holding `script` (spawn imports the main module, so a
        script cannot be given with -c), once per start method."""
        import tempfile
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "main_of_the_test.py")
            with open(path, "w") as f:
                f.write(script)
            for method in ("fork", "spawn", "forkserver"):
                with self.subTest(method=method):
                    check(path, method)

    def _kill_main_and_check(self, path, method):
        child = subprocess.Popen([sys.executable, path, method], stdout=subprocess.PIPE, env=dict(os.environ))
        try:
            line = child.stdout.readline().decode().split()
            self.assertEqual(len(line), 4, "the child did not start its loader")
            main, workers = int(line[0]), [int(p) for p in line[1:]]
            child.kill()
            child.wait(10)
            deadline = time.monotonic() + 5
            alive = workers
            while alive and time.monotonic() < deadline:
                alive = [p for p in alive if running(p)]
                time.sleep(0.05)
            self.assertEqual(alive, [], "workers outlived main by 5 s")
            deadline = time.monotonic() + 5
            while glob.glob("/dev/shm/tdshm.dl-{}-*".format(main)) and time.monotonic() < deadline:
                time.sleep(0.05)
            self.assertEqual(glob.glob("/dev/shm/tdshm.dl-{}-*".format(main)), [])
        finally:
            if child.poll() is None:
                child.kill()
            for entry in glob.glob("/dev/shm/tdshm.dl-{}-*".format(child.pid)):
                os.unlink(entry)  # what a failed check left: not for the next tests to find

    def test_a_workers_error_raised_out_of_the_program_leaves_nothing(self):
        # The error of worker 0's first batch ends the program; the other workers wait for main
        # to join their groups. At the exit, multiprocessing terminates them where they stand:
        # their groups stayed in /dev/shm (main never joined them, so it knew no name to sweep).
        script = textwrap.dedent("""
            import faulthandler, sys, torch, tdshm
            from torch.utils.data import Dataset
            class D(Dataset):
                def __len__(self): return 1000
                def __getitem__(self, i):
                    if i == 0:
                        raise ValueError("sample 0 is bad")
                    return torch.full((64, 128), float(i))
            if __name__ == "__main__":
                faulthandler.dump_traceback_later(40)  # where main hangs, if it does
                import atexit, time
                raised = []
                def excepthook(*args):
                    raised.append(time.monotonic())
                    sys.__excepthook__(*args)
                sys.excepthook = excepthook
                # Registered before the loader's: runs after it has ended the workers.
                atexit.register(lambda: print("ended after", time.monotonic() - raised[0], file=sys.stderr))
                for batch in tdshm.DataLoader(D(), batch_size=8, num_workers=3, multiprocessing_context=sys.argv[1]):
                    pass
        """)
        def check(path, method):
            child = subprocess.Popen([sys.executable, path, method], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                     text=True, env=dict(os.environ))
            try:
                _, err = child.communicate(timeout=60)
            except subprocess.TimeoutExpired:
                child.kill()
                _, err = child.communicate()
                self.fail("the program did not end within 60 s:\n" + err[-6000:])
            finally:
                if child.poll() is None:
                    child.kill()
                    child.wait()
            self.assertNotEqual(child.returncode, 0)
            self.assertIn("ValueError: sample 0 is bad", err)
            self.assertIn("in DataLoader worker process 0", err)
            # A worker that read main's stop with its tasks waited in a put for main until the
            # shutdown gave up on it (5 s) and terminated it (forkserver: 2 runs in 3).
            ended = float(err.split("ended after")[1].split()[0])
            self.assertLess(ended, 4.0, "the workers' shutdown waited for a worker")
            left = glob.glob("/dev/shm/tdshm.dl-{}-*".format(child.pid))
            for entry in left:
                os.unlink(entry)  # not for the next tests to find
            self.assertEqual(left, [])

        self._run_with_each_start_method(script, check)

    def test_ctrl_c_in_main_ends_the_loop_and_its_workers(self):
        # Main waits for a batch a worker takes 60 s to make; Ctrl-C (SIGINT to the process
        # group, as a terminal sends it) raises KeyboardInterrupt in main within a second, and
        # the workers and segments are gone within a few.
        script = textwrap.dedent("""
            import os, sys, time, torch, tdshm
            from torch.utils.data import Dataset
            class D(Dataset):
                def __len__(self): return 100
                def __getitem__(self, i):
                    if i >= 8: time.sleep(60)
                    return torch.full((64,), i)
            it = iter(tdshm.DataLoader(D(), batch_size=4, num_workers=2))
            next(it); next(it)
            print(os.getpid(), *[w.pid for w in it._workers], flush=True)
            try:
                next(it)
                print("returned", flush=True)
            except KeyboardInterrupt:
                print("interrupted", time.monotonic(), flush=True)
                del it
                print("closed", time.monotonic(), flush=True)
        """)
        child = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, env=dict(os.environ),
                                 start_new_session=True)
        try:
            line = child.stdout.readline().decode().split()
            self.assertEqual(len(line), 3, "the child did not start its loader")
            main, workers = int(line[0]), [int(p) for p in line[1:]]
            time.sleep(0.5)  # main waits in the feed now
            sent = time.monotonic()
            os.killpg(child.pid, signal.SIGINT)
            said = child.stdout.readline().decode().split()
            self.assertEqual(said[0], "interrupted", said)
            self.assertLess(float(said[1]) - sent, 1.0, "KeyboardInterrupt came late")
            said = child.stdout.readline().decode().split()
            self.assertEqual(said[0], "closed", said)
            self.assertLess(float(said[1]) - sent, 3.0, "the workers took long to end")
            child.wait(10)
            for p in workers:
                self.assertFalse(running(p), "worker {} outlived main's Ctrl-C".format(p))
            self.assertEqual(glob.glob("/dev/shm/tdshm.dl-{}-*".format(main)), [])
        finally:
            if child.poll() is None:
                child.kill()

    def test_ctrl_c_to_main_alone_with_a_worker_stuck_in_the_dataset(self):
        # SIGINT to main only (kill -INT, a supervisor): KeyboardInterrupt leaves the program, and
        # its exit ends the workers; one stuck in __getitem__ never reads "stop". That exit took
        # 5.2 s (torch's 0.16 s): the workers' grace at exit is 0.5 s now, then terminate.
        script = textwrap.dedent("""
            import os, time, torch, tdshm
            from torch.utils.data import Dataset
            class D(Dataset):
                def __len__(self): return 100
                def __getitem__(self, i):
                    if i >= 8: time.sleep(1000)
                    return torch.full((64,), i)
            it = iter(tdshm.DataLoader(D(), batch_size=4, num_workers=2))
            next(it); next(it)
            print(os.getpid(), *[w.pid for w in it._workers], flush=True)
            next(it)
        """)
        child = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                 env=dict(os.environ), start_new_session=True)
        try:
            line = child.stdout.readline().decode().split()
            self.assertEqual(len(line), 3, "the child did not start its loader")
            main, workers = int(line[0]), [int(p) for p in line[1:]]
            time.sleep(0.5)  # main waits in the feed, the workers sleep in __getitem__
            sent = time.monotonic()
            os.kill(main, signal.SIGINT)
            child.wait(10)
            self.assertLess(time.monotonic() - sent, 3.0, "the program took long to end")
            self.assertIn(b"KeyboardInterrupt", child.stderr.read())
            for p in workers:
                self.assertFalse(running(p), "worker {} outlived main".format(p))
            self.assertEqual(glob.glob("/dev/shm/tdshm.dl-{}-*".format(main)), [])
        finally:
            if child.poll() is None:
                child.kill()
            for p in workers if "workers" in locals() else []:
                try:
                    os.kill(p, signal.SIGKILL)
                except OSError:
                    pass

    def test_ctrl_c_during_the_first_batch_says_keyboard_interrupt_alone(self):
        # Ctrl-C in a terminal while the workers make their first batch: the workers end too, and
        # main, waiting to join the first one's group, reported that as a RuntimeError ("producer
        # 0 (process N ended)") with the KeyboardInterrupt chained to it; torch reports only the
        # KeyboardInterrupt.
        script = textwrap.dedent("""
            import os, time, torch, tdshm
            from torch.utils.data import Dataset
            class D(Dataset):
                def __len__(self): return 100
                def __getitem__(self, i):
                    time.sleep(5)
                    return torch.full((64,), i)
            print(os.getpid(), flush=True)
            for b in tdshm.DataLoader(D(), batch_size=4, num_workers=2):
                pass
        """)
        child = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                 env=dict(os.environ), start_new_session=True)
        try:
            main = int(child.stdout.readline())
            time.sleep(1.5)  # the workers sleep in their first item, main waits for worker 0
            os.killpg(child.pid, signal.SIGINT)
            child.wait(10)
            err = child.stderr.read().decode()
            self.assertEqual(child.returncode, -signal.SIGINT, err)
            self.assertIn("KeyboardInterrupt", err)
            self.assertNotIn("RuntimeError", err)
            self.assertEqual(glob.glob("/dev/shm/tdshm.dl-{}-*".format(main)), [])
        finally:
            if child.poll() is None:
                os.killpg(child.pid, signal.SIGKILL)

    def test_break_ends_the_workers_at_once(self):
        # Workers 1-3 made their first batch and wait for main to join their feed: leaving the
        # loop after batch 0 stops them without waiting for torch's 5 s grace.
        loader = tdshm.DataLoader(Samples(200), batch_size=2, num_workers=4)
        it = iter(loader)
        next(it)
        time.sleep(0.5)  # the other workers reach their first put
        start = time.monotonic()
        it._shutdown_workers()
        self.assertLess(time.monotonic() - start, 2.0)
        self.assertEqual([w.exitcode for w in it._workers], [0] * 4)
        self.assertEqual(segments(), set())
        del it, loader

    def test_leaving_after_the_first_batch_costs_what_torchs_does(self):
        # `next(iter(loader))`, or a `break` before every worker delivered: workers that made their
        # first batch wait for main to join their feed (and grow it: these batches outgrow the
        # first heap). Each such end cost 0.2 s, against torch's 0.01 s: the workers saw main's
        # stop only between 200 ms slices of that wait.
        def ends(make):
            spent = 0.0
            for _ in range(8):
                it = iter(make())
                batch = next(it)
                time.sleep(0.05)  # the other workers reach their first put
                start = time.monotonic()
                del it
                spent += time.monotonic() - start
                self.assertEqual(batch["image"].shape, (32, 3, 64, 64))
            return spent

        images = Images()
        torch_spent = ends(lambda: TorchLoader(images, batch_size=32, num_workers=4))
        shm_spent = ends(lambda: tdshm.DataLoader(images, batch_size=32, num_workers=4))
        print("8 ends: torch {:.3f} s, tdshm {:.3f} s".format(torch_spent, shm_spent), file=sys.stderr)
        self.assertLess(shm_spent, 3 * torch_spent + 0.4, "torch's 8 ends took {:.2f} s".format(torch_spent))
        self.assertEqual(segments(), set())

    def test_a_loader_killed_whole_leaves_nothing(self):
        # SIGTERM, SIGHUP or SIGKILL to the whole process group (`timeout`, a scheduler's stop, a
        # closed terminal): main and workers end at once and none runs any clean-up. The feed's
        # groups stayed in /dev/shm (two heaps) every time; their names now go once they formed.
        script = textwrap.dedent("""
            import sys, time, torch, tdshm
            from torch.utils.data import Dataset
            class D(Dataset):
                def __len__(self): return 10 ** 6
                def __getitem__(self, i):
                    time.sleep(0.005)
                    return torch.full((64 << 10,), float(i))
            loader = tdshm.DataLoader(D(), batch_size=4, num_workers=2, persistent_workers=sys.argv[1] == "1")
            for k, b in enumerate(loader):
                if k == 5:
                    print("ready", flush=True)
        """)
        for sig, persistent in ((signal.SIGTERM, "0"), (signal.SIGKILL, "1"), (signal.SIGHUP, "0")):
            child = subprocess.Popen([sys.executable, "-c", script, persistent], stdout=subprocess.PIPE,
                                     env=dict(os.environ), start_new_session=True)
            try:
                self.assertEqual(child.stdout.readline().strip(), b"ready")
                os.killpg(child.pid, sig)
                child.wait(30)
                deadline = time.monotonic() + 5  # the workers die with main, a moment later
                while time.monotonic() < deadline and subprocess.run(["pgrep", "-s", str(child.pid)],
                                                                     capture_output=True).returncode == 0:
                    time.sleep(0.05)
                left = glob.glob("/dev/shm/tdshm.dl-{}-*".format(child.pid))
                for entry in left:
                    os.unlink(entry)  # not for the next tests to find
                self.assertEqual(left, [], signal.Signals(sig).name)
            finally:
                if child.poll() is None:
                    os.killpg(child.pid, signal.SIGKILL)
                    child.wait()
                child.stdout.close()

    def test_batches_of_70_mib_arrive(self):
        # A heap for 70 MiB batches (841 MiB) took the worker longer to size than the 200 ms
        # rendezvous slice: main timed out on its lock ("exited unexpectedly"), and once that
        # was retried the worker made the heap anew at every slice and the group never formed.
        class Big(Dataset):
            def __len__(self):
                return 3

            def __getitem__(self, i):
                return torch.full((70 << 18,), float(i))

        got = [float(b[0]) + float(b[-1]) for b in tdshm.DataLoader(Big(), batch_size=None, num_workers=1, timeout=60)]
        self.assertEqual(got, [0.0, 2.0, 4.0])
        self.assertEqual(glob.glob("/dev/shm/tdshm.dl-{}-*".format(os.getpid())), [])

    def test_eight_workers_fit_a_64_mib_dev_shm(self):
        # Docker's default /dev/shm: a private mount namespace with a 64 MiB tmpfs over /dev/shm
        # (root and unshare needed; skipped otherwise). 8 workers, batches of 1.31 MiB: every batch
        # arrives intact, the peak stays under 64 MiB, nothing is left.
        script = textwrap.dedent("""
            import os, torch, tdshm
            from torch.utils.data import Dataset
            class D(Dataset):
                def __len__(self): return 48 * 64
                def __getitem__(self, i):
                    return {"image": torch.full((3, 64, 64), i % 256, dtype=torch.uint8),
                            "x": torch.full((64, 64), float(i))}
            def used():
                st = os.statvfs("/dev/shm")
                return (st.f_blocks - st.f_bfree) * st.f_frsize
            peak, n = 0, 0
            for b in tdshm.DataLoader(D(), batch_size=48, num_workers=8):
                first = n * 48
                assert int(b["image"][0, 0, 0, 0]) == first % 256 and float(b["x"][-1, 0, 0]) == first + 47, n
                n += 1
                peak = max(peak, used())
            print(n, peak, len(os.listdir("/dev/shm")))
        """)
        probe = subprocess.run(["unshare", "-m", "sh", "-c", "mount -t tmpfs -o size=64m tmpfs /dev/shm"],
                               capture_output=True)
        if probe.returncode != 0:
            self.skipTest("no private mount namespace here: " + probe.stderr.decode().strip())
        run = subprocess.run(["unshare", "-m", "sh", "-c", 'mount -t tmpfs -o size=64m tmpfs /dev/shm && exec "$0" -c "$1"',
                              sys.executable, script], capture_output=True, env=dict(os.environ), timeout=120)
        self.assertEqual(run.returncode, 0, run.stderr.decode()[-2000:])
        n, peak, left = (int(v) for v in run.stdout.decode().split())
        self.assertEqual(n, 64)
        self.assertLess(peak, 64 << 20)
        self.assertEqual(left, 0)


class TaskRingTest(unittest.TestCase):
    """tdshm._C.TaskRing, main's messages to a forked worker through shared anonymous memory."""

    def ring_pair(self, slots=4):
        memory = mmap.mmap(-1, TaskRing.bytes_for(slots))
        return memory, TaskRing(memory, slots, True), TaskRing(memory, slots, False)

    def test_messages_in_order_and_the_marker_for_long_ones(self):
        _, writer, reader = self.ring_pair()
        long = b"x" * (TaskRing.slot_payload + 1)
        self.assertTrue(writer.put(b"first"))
        self.assertFalse(writer.put(long))  # the marker: the caller sends it through the pipe
        self.assertTrue(writer.put(b"b" * TaskRing.slot_payload))
        self.assertEqual(reader.try_get(), b"first")
        self.assertEqual(reader.try_get(), b"")
        self.assertEqual(reader.get(timedelta(0), timedelta(seconds=1)), b"b" * TaskRing.slot_payload)
        self.assertIsNone(reader.try_get())
        for i in range(10):  # around the ring's end more than once
            self.assertTrue(writer.put(str(i).encode()))
            self.assertEqual(reader.try_get(), str(i).encode())

    def test_tasks_of_ints_without_a_pickle(self):
        _, writer, reader = self.ring_pair(slots=8)
        longest = list(range(-30, 31))  # 61 ints fill a slot
        tasks = [(3, 2 ** 63 - 1), (-1, -(2 ** 63)), (7, []), (8, [5, 2 ** 62, -4]), (9, longest)]
        for idx, index in tasks:
            self.assertTrue(writer.put_task(idx, index), (idx, index))
        refused = [(1, 2 ** 64), (1, True), (1, "a"), (1.0, 2), (1, (2, 3)), (1, [2, "a"]), (1, [True]),
                   (1, [2 ** 64]), (1, longest + [0])]
        for idx, index in refused:
            self.assertFalse(writer.put_task(idx, index), (idx, index))
        for idx, index in tasks:
            self.assertEqual(reader.try_get(), ("task", idx, index))
        self.assertIsNone(reader.try_get())  # nothing went in for the refused ones

    def test_a_full_ring_is_an_error_not_a_wait(self):
        _, writer, reader = self.ring_pair(slots=2)
        writer.put(b"1")
        writer.put(b"2")
        with self.assertRaises(RuntimeError):
            writer.put(b"3")
        self.assertEqual(reader.try_get(), b"1")
        self.assertTrue(writer.put(b"3"))

    def test_get_times_out_with_none(self):
        _, _, reader = self.ring_pair()
        start = time.monotonic()
        self.assertIsNone(reader.get(timedelta(microseconds=100), timedelta(milliseconds=50)))
        self.assertGreaterEqual(time.monotonic() - start, 0.045)

    def test_bad_memory(self):
        with self.assertRaises(ValueError):
            TaskRing(mmap.mmap(-1, 4096), 64, True)  # too small for 64 slots
        with self.assertRaises(ValueError):
            TaskRing(mmap.mmap(-1, TaskRing.bytes_for(4)), 4, False)  # no ring written there
        with self.assertRaises(ValueError):
            TaskRing(mmap.mmap(-1, TaskRing.bytes_for(4)), 0, True)
        memory, _, _ = self.ring_pair(slots=4)
        with self.assertRaises(ValueError):
            TaskRing(memory, 3, False)  # a ring of 4 slots, read as 3

    def test_a_sleeping_reader_in_a_forked_child_is_woken(self):
        # The child spins 100 us, then sleeps in its futex wait; each message wakes it, and it
        # answers through a pipe with what it read.
        memory, writer, _ = self.ring_pair(slots=8)
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            try:
                os.close(r)
                reader = TaskRing(memory, 8, False)
                for _ in range(3):
                    got = reader.get(timedelta(microseconds=100), timedelta(seconds=20))
                    os.write(w, b"none" if got is None else got)
            finally:
                os._exit(0)
        os.close(w)
        try:
            for message in (b"one", b"two", b"three"):
                time.sleep(0.05)  # the child is asleep by now
                writer.put(message)
                readable, _, _ = select.select([r], [], [], 5)
                self.assertTrue(readable, "the sleeping reader was not woken within 5 s")
                self.assertEqual(os.read(r, 64), message)
        finally:
            os.close(r)
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)


class LeafIdsTest(unittest.TestCase):
    """tdshm._C.LeafIds, the workers' persistent_id: tensors set aside, every other object None."""

    def test_tensors_set_aside_in_order(self):
        ids = LeafIds(torch.Tensor)
        a, b = torch.ones(2), torch.zeros(1, dtype=torch.int64)
        self.assertIsNone(ids({"a": 1}))
        self.assertEqual(ids(a), 0)
        # Not plain: pickled, their __reduce_ex__ handing their plain parts back to ids.
        for other in (None, 3, 2.5, "s", b"b", [a], (a,), True, torch.float32, torch.nn.Parameter(torch.zeros(1)),
                      torch.ones(1, requires_grad=True), torch.eye(2).to_sparse(), torch.ones(2, dtype=torch.cfloat).conj()):
            self.assertIsNone(ids(other))
        self.assertEqual(ids(b), 1)
        self.assertEqual(ids(a), 2)  # each time it is met (a pickler asks before its memo)
        taken = ids.take()
        self.assertEqual(len(taken), 3)
        self.assertIs(taken[0], a)
        self.assertIs(taken[1], b)
        self.assertEqual(ids.take(), [])
        self.assertEqual(ids(b), 0)  # ids start again after a take

    def test_as_a_picklers_persistent_id(self):
        import io
        import pickle
        ids = LeafIds(torch.Tensor)
        buf = io.BytesIO()
        pickler = pickle.Pickler(buf, protocol=pickle.HIGHEST_PROTOCOL)
        pickler.persistent_id = ids
        t = torch.arange(4)
        pickler.dump({"x": t, "y": [t, 7, "z"]})
        leaves = ids.take()
        self.assertEqual(len(leaves), 2)
        self.assertTrue(all(leaf is t for leaf in leaves))
        unpickler = pickle.Unpickler(io.BytesIO(buf.getvalue()))
        unpickler.persistent_load = leaves.__getitem__
        out = unpickler.load()
        self.assertIs(out["x"], t)
        self.assertIs(out["y"][0], t)
        self.assertEqual(out["y"][1:], [7, "z"])

    def test_bad_arguments(self):
        with self.assertRaises(TypeError):
            LeafIds(3)  # not a type
        ids = LeafIds(torch.Tensor)
        with self.assertRaises(TypeError):
            ids()
        with self.assertRaises(TypeError):
            ids(1, 2)
        with self.assertRaises(TypeError):
            ids(obj=1)


class AnswerCodecTest(unittest.TestCase):
    """tdshm._C.AnswerCodec: a worker's answer as header bytes and tensors, without pickle."""

    def setUp(self):
        self.codec = AnswerCodec(torch.Tensor)

    def round_trip(self, payload, convert=False):
        split = self.codec.encode("data", 7, payload, convert)
        self.assertIsNotNone(split, "encoded: {!r}".format(payload))
        header, leaves = split
        return self.codec.decode(header, leaves), leaves

    def test_plain_trees_round_trip(self):
        a, b = torch.arange(3), torch.ones(2)
        tree = {"a": a, "n": [None, True, False, 0, -1, 2 ** 63 - 1, -2 ** 63, 1.5, float("-inf"), -0.0],
                "s": ("", "\u00e9\u4e2d\U0001f600", b"", b"\x00\xff"), "d": {1: (a, b), None: [], 2.5: {}, b"k": ()},
                "again": a}
        (kind, idx, out), leaves = self.round_trip(tree)
        self.assertEqual((kind, idx), ("data", 7))
        self.assertEqual([id(t) for t in leaves], [id(a), id(a), id(b), id(a)])  # in order, each time met
        self.assertIs(out["a"], a)
        self.assertIs(out["d"][1][1], b)
        self.assertEqual(out["n"], tree["n"])
        self.assertEqual(str(out["n"][-1]), "-0.0")
        self.assertEqual(out["s"], tree["s"])
        self.assertIs(type(out["s"]), tuple)
        self.assertEqual(list(out["d"]), [1, None, 2.5, b"k"])
        self.assertEqual((out["d"][None], out["d"][2.5], out["d"][b"k"]), ([], {}, ()))
        nan = self.round_trip(float("nan"))[0][2]
        self.assertNotEqual(nan, nan)

    def test_convert_is_torchs_default_convert(self):
        from torch.utils.data._utils.collate import default_convert
        shared = [1, 2]
        for payload in ({"t": (torch.ones(1), (2, [3, (4,)])), "l": [shared, shared]}, (1, "a"), [(), [()]], 5,
                        None, "s", {}):
            with self.subTest(payload=payload):
                (kind, idx, out), _ = self.round_trip(payload, convert=True)
                self.assertEqual((kind, idx), ("data", 7))  # the answer's tuple stays one
                same(default_convert(payload), out)
        out = self.round_trip({"l": [shared, shared]}, convert=True)[0][2]
        self.assertIsNot(out["l"][0], out["l"][1])  # as default_convert makes them
        self.assertIs(type(self.round_trip((1, 2))[0][2]), tuple)  # not converted: a tuple

    def test_what_only_pickle_keeps_is_left_to_it(self):
        shared = [1]
        looped = [1]
        looped.append(looped)
        deep = []
        for _ in range(70):
            deep = [deep]
        others = [Pair(1, 2), collections.OrderedDict(a=1), 2 ** 64, -2 ** 63 - 1, torch.float32, object(),
                  torch.nn.Parameter(torch.ones(1)), torch.ones(1, requires_grad=True), torch.eye(2).to_sparse(),
                  {(1, 2): 3}, {"k": [shared, shared]}, looped, deep, [[i] for i in range(300)], "\ud800",
                  bytearray(b"x"), type("Int", (int,), {})(5)]  # an int subclass
        if numpy is not None:
            others += [numpy.arange(3), numpy.float64(1.5)]
        for payload in others:
            with self.subTest(payload=type(payload).__name__):
                self.assertIsNone(self.codec.encode("data", 7, payload, False))
        self.assertIsNone(self.codec.encode("data", 7, looped, True))  # converted, a loop never ends
        self.assertIsNotNone(self.codec.encode("data", 7, {"k": [shared, shared]}, True))
        self.assertIsNotNone(self.round_trip([[i] for i in range(250)]))

    def test_a_pickle_is_not_decoded(self):
        import pickle
        self.assertIsNone(self.codec.decode(pickle.dumps(("data", 1, 2), protocol=5), []))
        self.assertIsNone(self.codec.decode(b"", []))

    def test_a_malformed_header_is_a_value_error(self):
        t = torch.ones(1)
        header, leaves = self.codec.encode("data", 7, {"a": [t, "xyz", 1.5, (None,)], "b": t}, False)
        for cut in range(4, len(header)):  # every header cut short
            with self.subTest(cut=cut), self.assertRaises(ValueError):
                self.codec.decode(header[:cut], leaves)
        bad = [header + b"N",                                   # bytes after the end
               header[:4] + b"Q",                               # an unknown tag
               header[:4] + b"U\xff\xff\xff\x7f",           # a count past the bytes
               header[:4] + b"U\x01\x00\x00\x00s\xff\x00\x00\x00ab",  # a string past the bytes
               header[:4] + b"U\x01\x00\x00\x00s\x02\x00\x00\x00\xff\xfe",  # not UTF-8
               header[:4] + b"D\x01\x00\x00\x00L\x00\x00\x00\x00N",  # a list as a key
               header[:4] + b"L\x01\x00\x00\x00" * 80 + b"N"]  # too deep
        for h in bad:
            with self.subTest(header=h[:24]), self.assertRaises(ValueError):
                self.codec.decode(h, leaves)
        with self.assertRaises(ValueError):
            self.codec.decode(header, leaves[:1])  # fewer tensors than it uses
        with self.assertRaises(ValueError):
            self.codec.decode(header, leaves + [t])  # more than it uses

    def test_mutated_headers_decode_or_raise_value_error(self):
        # A hostile or broken worker's header: every byte changed, dropped or repeated in turn,
        # and random mutations; each decodes to something or is a ValueError, never a crash.
        import random
        t = torch.ones(2)
        header, leaves = self.codec.encode("data", 7, {"a": [t, "xyz", 1.5, (None, True)], "b": {3: t, b"k": -2}},
                                           False)
        candidates = []
        for i in range(len(header)):
            for b in (0, 1, 0x7F, 0xFF, header[i] ^ 0x55):
                candidates.append(header[:i] + bytes([b]) + header[i + 1:])
            candidates.append(header[:i] + header[i + 1:])
            candidates.append(header[:i] + header[i:i + 1] * 2 + header[i + 1:])
        rng = random.Random(4321)
        for _ in range(3000):
            h = bytearray(header)
            for _ in range(rng.randint(1, 4)):
                h[rng.randrange(4, len(h))] = rng.randrange(256)
            candidates.append(bytes(h))
        for h in candidates:
            try:
                self.codec.decode(h, leaves)
            except ValueError:
                pass

    def test_bad_arguments(self):
        with self.assertRaises(TypeError):
            AnswerCodec(3)
        with self.assertRaises(TypeError):
            self.codec.encode("data", 1, 2)
        with self.assertRaises(TypeError):
            self.codec.decode("not bytes", [])
        with self.assertRaises(TypeError):
            self.codec.decode(b"TDA1", ())


if __name__ == "__main__":
    # A hang anywhere (a test, a finalizer run by the collector, the interpreter's exit) prints
    # every thread's stack and fails before ctest's 300 s timeout kills the run without one.
    faulthandler.dump_traceback_later(240, exit=True)
    unittest.main()
