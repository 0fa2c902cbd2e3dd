"""tdshm.DataLoader: torch's DataLoader whose workers hand batches to the main process through
shared memory, zero copy (docs/loader.md).

The constructor, the sampling, the order of the batches, the worker seeds, get_worker_info() and
the failures are torch 1.13's: this class *is* a torch.utils.data.DataLoader, and only its
multi-process iterator differs. How a batch travels:

* main sends each worker its tasks (the sampler's indices), as torch's index queues do: through
  a TaskRing in memory main maps before it forks the worker (with "spawn" or "forkserver", and
  for a task longer than a ring slot, through a pipe);
* each worker answers every task exactly once, in order, as one item of a tdshm feed
  (tdshm::FeedProducer / FeedConsumer, include/tdshm/feed.h): a private two-rank shm group per
  worker, never the user's default group. An item is a header (the answer with every tensor
  left out: AnswerCodec's bytes for a tree of plain values, else a pickle) and the tensors. A
  tensor in the worker's heap goes by reference and main receives a view of it, no copy; the
  default collate stacks the samples straight into the heap, a tensor of at most 4 KiB goes by
  value, and any other is copied into the heap (or, when main holds the heap, sent by value:
  never a wait, never an overwrite);
* the heap is sized from the worker's first batch (the feed grows its group when a batch
  outgrows it).

A batch's views give their bytes back when the batch is dropped; `list(loader)` or a batch kept
past the next step only keeps its worker's heap busy (later batches then travel by value).
"""

import atexit
import functools
import io
import itertools
import mmap
import operator
import os
import pickle
import random
import select
import time
import uuid
import weakref
from datetime import timedelta

import torch
import torch.utils.data as _data
from torch.utils.data import _utils
from torch.utils.data._utils import collate as _collate
from torch.utils.data._utils import worker as _worker
from torch.utils.data.dataloader import _BaseDataLoaderIter, _DatasetKind

from ._C import FeedConsumer, FeedProducer, LeafIds, TaskRing

__all__ = ["DataLoader"]

_WATCH = 0.5  # seconds between a worker's checks that main still runs
_HEAP_BATCHES = 4  # batches beyond the prefetched ones a heap holds (batches held, fragmentation)
_HEAP_MIN_BYTES = 64 << 10  # a worker's allocations at least this large are made in its heap
_SPIN = timedelta(microseconds=20)  # a worker's short spin: the others need the CPUs it would spin on
# Main spins longer before it sleeps: one batch in ~15 waits longer than 20 µs for its worker, and a
# sleeping main costs that worker a wake-up and main two switches (whole batches 1.03-1.07x, 4
# scalars 1.06x; 1 ms samples unchanged, at the CPUs' bound).
_MAIN_SPIN = timedelta(microseconds=100)
# A worker out of tasks polls its ring (or pipe), yielding the CPU, this long before it sleeps:
# main's write that wakes a sleeping worker cost main ~2 µs a batch (the wake-up), the worker ~1 µs,
# and the CPUs sat 16-20 % idle between the two (whole batches 1.16x, 4 scalars 1.16x faster).
_TASK_SPIN = 100e-6
_RING_SPIN, _RING_WATCH = timedelta(seconds=_TASK_SPIN), timedelta(seconds=_WATCH)


class _MainGone(Exception):
    """The main process died or left the worker's feed, or told it to stop: the worker ends."""


def _main_left(e):
    text = str(e)
    return "left the group" in text or "is gone" in text or "was destroyed" in text


def _start_time(pid):
    """Process `pid`'s start time (its /proc stat field 22), or None once it has exited (a zombie
    has): with the pid, it names one process, not a later one given the same pid."""
    try:
        with open("/proc/{}/stat".format(pid), "rb") as f:
            stat = f.read()
    except OSError:
        return None
    fields = stat[stat.rfind(b")") + 2:].split()
    if len(fields) < 20 or fields[0] in (b"Z", b"X"):
        return None
    return int(fields[19])


class _Main:
    """Main's process as a worker sees it. Not through the worker's parent pid: a forkserver's
    workers are the fork server's children from the start (a worker out of tasks for 0.5 s took
    main for gone and left), and main's exit changes a forked worker's parent before that exit has
    ended."""

    def __init__(self, pid):
        self.pid = pid
        self.start = _start_time(pid)

    def runs(self):
        return self.start is not None and _start_time(self.pid) == self.start

    def wait_exited(self, seconds):
        """Waits up to `seconds` until main has exited. A worker that finds main gone through its
        pipe (closed as main's exit closes its files) sees it before main's exit has ended: a
        group it left then still counted main as alive, stayed in /dev/shm, and nobody was left to
        remove it (main killed, spawn or forkserver workers: one group in three of four runs)."""
        give_up = time.monotonic() + seconds
        while self.runs() and time.monotonic() < give_up:
            time.sleep(0.002)


# An answer travels as header bytes and its tensors. For the trees batches usually are, the
# header is AnswerCodec's (answer_codec.cpp), written and read in one C walk on each side
# (FeedProducer.put_answer, FeedConsumer.next_answer; a whole batch: 0.15 µs to encode, its
# default_convert included, and 0.17 to decode, against 1.1 and 0.64 for default_convert, pickle
# and unpickle); an answer holding anything else is pickled (_Splitter).


class _Splitter:
    """Pickles an answer with every tensor left out: (header bytes, tensors), each tensor's place
    in the header its index among them. One pickler for the worker's life (a new one per answer,
    with its buffer, cost as much again as the pickling); its persistent_id is a C callable
    (LeafIds: a Python one cost a frame per object pickled, 1.06 µs a whole batch against 0.45)."""

    def __init__(self):
        self._buf = io.BytesIO()
        self._pickler = pickle.Pickler(self._buf, protocol=pickle.HIGHEST_PROTOCOL)
        self._leaves = LeafIds(torch.Tensor)
        self._pickler.persistent_id = self._leaves

    def split(self, obj):
        buf = self._buf
        buf.seek(0)
        buf.truncate()
        try:
            self._pickler.dump(obj)
        finally:
            self._pickler.clear_memo()  # it holds every object pickled: the batch, its tensors
            leaves = self._leaves.take()  # (also after a failed dump: the next ids start at 0)
        return buf.getvalue(), leaves


def _unpickle(header, leaves):
    """The answer _Splitter.split pickled, its tensors put back."""
    unpickler = pickle.Unpickler(io.BytesIO(header))
    unpickler.persistent_load = leaves.__getitem__  # no Python frame per tensor
    return unpickler.load()


# Main's messages to a worker, pickled: with the "fork" start method through a TaskRing, memory
# main maps before it forks the worker (a pipe write and the worker's poll and read cost each ~1 µs
# a task); a message longer than a ring slot, and every message under "spawn" or "forkserver",
# through a pipe as a 4-byte length and the pickle, in one write (a Connection's send pickles with
# torch's reducers and its recv reads twice, which cost more than the rest of a task's round).


def _write(fd, data):
    view = memoryview(len(data).to_bytes(4, "little") + data)
    while view:  # a write larger than the pipe's buffer, or one a signal cut short, goes on
        view = view[os.write(fd, view):]


class _Inbox:
    """A worker's end of main's pipe: the messages read so far."""

    def __init__(self, conn):
        self.fd = conn.fileno()
        self.buf = bytearray()

    def _pop(self):
        """The first message the bytes read so far complete, or None."""
        if len(self.buf) < 4:
            return None
        n = int.from_bytes(self.buf[:4], "little")
        if len(self.buf) < 4 + n:
            return None
        msg = pickle.loads(self.buf[4:4 + n])
        del self.buf[:4 + n]
        return msg

    def read(self):
        """The messages completed by what the pipe holds now (it must be readable: a read that
        finds nothing means main closed its end, EOFError)."""
        data = os.read(self.fd, 1 << 16)
        if not data:
            raise EOFError
        self.buf += data
        msgs = []
        while (msg := self._pop()) is not None:  # a message is a tuple, never None
            msgs.append(msg)
        return msgs

    def next_message(self, readable, still_needed):
        """The next message alone (the one a ring's marker announced), waiting for it; None once
        the pipe closed or still_needed() says main is gone."""
        while (msg := self._pop()) is None:
            while not readable.poll(int(_WATCH * 1000)):
                if not still_needed():
                    return None
            data = os.read(self.fd, 1 << 16)
            if not data:
                return None
            self.buf += data
        return msg


# ---------------------------------------------------------------------------------------------
# Worker side


class _Outbox:
    """A worker's answers to main: the items of its feed producer."""

    def __init__(self, name, index, num_workers, prefetch, parent, tasks, ring):
        self.index = index
        self.parent = parent
        self.main = _Main(parent)
        self.ring = ring  # a TaskRing, or None: every message comes through the pipe
        self.inbox = _Inbox(tasks)
        # One poll object for the pipe: Connection.poll builds a selector on every call (a third
        # of what reading a task cost the worker).
        self.readable = select.poll()
        self.readable.register(tasks.fileno(), select.POLLIN)
        self.early = []  # tasks read while a put waited (see _check)
        # Main's "stop" read together with tasks (a worker that starts slowly, as forkserver's do,
        # finds its first tasks and the stop in one read): the tasks before it are not wanted, and
        # a put waiting for main must end at once (it waited for a join main never made, until
        # main's shutdown gave up on it and terminated it).
        self.stopping = False
        self.orphaned = False  # main died (not: told this worker to stop, or left the feed)
        self.splitter = _Splitter()
        # Each worker's group may take its share of /dev/shm (8 workers fit Docker's 64 MiB); the
        # first group is small (a heap sized from the first batch follows).
        self.producer = FeedProducer(name, index, items_in_heap=prefetch + _HEAP_BATCHES, spin=_SPIN,
                                     watch_pid=parent, check=self._check, first_heap_bytes=256 << 10,
                                     shm_share=1.0 / num_workers)

    def _check(self):
        # Run while a put waits for main (its first join, room): a "stop" ends the wait (main shut
        # the iterator down and will not join); tasks are kept for the loop.
        if self.stopping:
            raise _MainGone()
        if self.ring is not None:
            while True:
                data = self.ring.try_get()
                if data is None:
                    return
                msg = self._from_ring(data)
                if msg is None:
                    self.orphaned = True
                if msg is None or msg[0] == "stop":
                    raise _MainGone()
                self._keep(msg)
        while self.readable.poll(0):
            try:
                msgs = self.inbox.read()
            except EOFError:
                self.orphaned = True
                raise _MainGone() from None
            for msg in msgs:
                if msg[0] == "stop":
                    raise _MainGone()
                self._keep(msg)

    def _main_runs(self):
        return self.main.runs()

    def _from_ring(self, data):
        """The message a ring slot holds (a task as ("task", idx, index) already, a pickle, or b"":
        the one main wrote to the pipe), or None once main is gone."""
        if type(data) is tuple:
            return data
        if data:
            return pickle.loads(data)
        return self.inbox.next_message(self.readable, self._main_runs)

    def _keep(self, msg):
        # Main's tasks come as ("tasks", [(idx, index), ...]): the first prefetch_factor together.
        if msg[0] == "tasks":
            self.early.extend(("task", idx, index) for idx, index in msg[1])
        elif msg[0] == "stop":
            self.stopping = True
        else:
            self.early.append(msg)

    def next_task(self):
        """The next message from main, or None once main is gone."""
        if self.stopping:
            return ("stop",)
        if self.ring is not None:
            while not self.early:
                # Spins _TASK_SPIN, then sleeps; main gone: ends within _WATCH seconds.
                data = self.ring.get(_RING_SPIN, _RING_WATCH)
                if type(data) is tuple:
                    return data  # a task, the common case
                if data is None:
                    if not self._main_runs():
                        return None
                    continue
                msg = self._from_ring(data)
                if msg is None:
                    return None
                self._keep(msg)
                if self.stopping:
                    return ("stop",)
            return self.early.pop(0)
        while not self.early and not self.stopping:
            if not self.readable.poll(0):
                give_up = time.perf_counter() + _TASK_SPIN
                while not self.readable.poll(0) and time.perf_counter() < give_up:
                    os.sched_yield()
            # Main gone (killed, or it exited without closing us): end within _WATCH seconds.
            while not self.readable.poll(int(_WATCH * 1000)):  # data, or the pipe closed (POLLHUP)
                if not self._main_runs():
                    return None
            try:
                msgs = self.inbox.read()
            except EOFError:
                return None
            for msg in msgs:
                self._keep(msg)
        return ("stop",) if self.stopping else self.early.pop(0)

    def loan_like(self, shape, dtype):
        """A tensor in the heap, or None (no heap yet, or no room)."""
        return self.producer.try_loan(list(shape), dtype)

    def answer(self, kind, idx, payload, convert=False):
        """kind: "data" (payload: the batch), "error" (an ExceptionWrapper), "stop", "resumed".
        convert: the payload is a sample as the dataset gave it, which torch's default_convert
        makes the batch (batch_size=None): the codec converts it as it writes it, or _convert does
        (what it raises is the answer then). Raises _MainGone once main left the feed (it shut
        the iterator down) or died."""
        try:
            if self.producer.put_answer(kind, idx, payload, convert):
                return
        except RuntimeError as e:
            self._put_failed(e)
        if convert:
            try:
                payload = _convert(payload)
            except Exception:
                kind, payload = "error", _utils.ExceptionWrapper(
                    where="in DataLoader worker process {}".format(self.index))
        header, leaves = self.splitter.split((kind, idx, payload))
        try:
            self.producer.put(header, leaves)
        except RuntimeError as e:
            self._put_failed(e)

    def _put_failed(self, e):
        if "is gone" in str(e) or not self._main_runs():
            self.orphaned = True
        if _main_left(e) or self.orphaned:
            raise _MainGone() from None
        raise e

    def close(self):
        self.producer = None


def _loan_collate_fn_map(outbox):
    """torch's default_collate, with tensors stacked straight into loans when there is room."""

    def collate_tensor(batch, *, collate_fn_map=None):
        elem = batch[0]
        if elem.is_nested or elem.layout != torch.strided:
            return _collate.collate_tensor_fn(batch, collate_fn_map=collate_fn_map)
        out = outbox.loan_like((len(batch),) + tuple(elem.shape), elem.dtype)
        if out is None:
            return torch.stack(batch, 0)
        return torch.stack(batch, 0, out=out)

    fn_map = dict(_collate.default_collate_fn_map)
    fn_map[torch.Tensor] = collate_tensor
    return fn_map


def _convert(data):
    """torch's default_convert (batch_size=None), its commonest cases in fewer steps: a tensor, a
    plain dict of them, a number or a string are what default_convert returns for them."""
    t = type(data)
    if t is torch.Tensor or t is int or t is float or t is str:
        return data
    if t is dict:
        return {key: _convert(value) for key, value in data.items()}
    return _collate.default_convert(data)


def _as_fetched(data):
    return data


def _worker_main(dataset_kind, dataset, tasks, auto_collation, collate_fn, drop_last, base_seed,
                 init_fn, worker_id, num_workers, prefetch, name, parent, ring_memory, ring_slots):
    """A worker: torch's _worker_loop, answering over tdshm."""
    from torch.utils.data._utils import signal_handling
    try:
        signal_handling._set_worker_signal_handlers()
        torch.set_num_threads(1)
        seed = base_seed + worker_id
        random.seed(seed)
        torch.manual_seed(seed)
        if _worker.HAS_NUMPY:
            import numpy as np
            np.random.seed(_worker._generate_state(base_seed, worker_id))
        _worker._worker_info = _worker.WorkerInfo(id=worker_id, num_workers=num_workers, seed=seed, dataset=dataset)
        ring = None if ring_memory is None else TaskRing(ring_memory, ring_slots, False)
        outbox = _Outbox(name, worker_id, num_workers, prefetch, parent, tasks, ring)
        # For the worker's life, what it makes of 64 KiB or more (the dataset's and the collate's
        # tensors) lies in its heap once there is one, and travels by reference (a scope per
        # batch cost more than the rest of the worker's bookkeeping).
        heap_scope = outbox.producer.heap_allocations(_HEAP_MIN_BYTES)
        # default_convert (batch_size=None) runs where the answer is written (answer(convert=True)).
        convert = collate_fn is _collate.default_convert
        if convert:
            collate_fn = _as_fetched
        elif collate_fn is _collate.default_collate:
            fn_map = _loan_collate_fn_map(outbox)
            collate_fn = lambda batch: _collate.collate(batch, collate_fn_map=fn_map)  # noqa: E731

        def make_fetcher():
            """What fetches one task's data: torch's fetcher's fetch."""
            if dataset_kind == _DatasetKind.Map and not auto_collation and collate_fn is _as_fetched:
                return functools.partial(operator.getitem, dataset)  # that fetch, without its two Python calls
            return _DatasetKind.create_fetcher(dataset_kind, dataset, auto_collation, collate_fn, drop_last).fetch

        init_exception = None
        fetch = None
        try:
            if init_fn is not None:
                init_fn(worker_id)
            fetch = make_fetcher()
        except Exception:
            init_exception = _utils.ExceptionWrapper(where="in DataLoader worker process {}".format(worker_id))
        iteration_end = False
        while True:
            msg = outbox.next_task()
            if msg is None:
                outbox.orphaned = True
                return
            kind = msg[0]
            if kind == "stop":
                return
            if kind == "resume":
                iteration_end = False
                try:
                    fetch = make_fetcher()
                except Exception:
                    init_exception = _utils.ExceptionWrapper(where="in DataLoader worker process {}".format(worker_id))
                outbox.answer("resumed", None, None)
                continue
            _, idx, index = msg
            if init_exception is not None:
                outbox.answer("error", idx, init_exception)
                init_exception = None
                continue
            if iteration_end:
                outbox.answer("stop", idx, worker_id)
                continue
            try:
                data = fetch(index)
            except Exception as e:
                if isinstance(e, StopIteration) and dataset_kind == _DatasetKind.Iterable:
                    iteration_end = True
                    outbox.answer("stop", idx, worker_id)
                else:
                    outbox.answer("error", idx,
                                  _utils.ExceptionWrapper(where="in DataLoader worker process {}".format(worker_id)))
                continue
            try:
                outbox.answer("data", idx, data, convert)
            except _MainGone:
                raise
            except Exception:
                # A batch that cannot travel (an object pickle refuses, a tensor put refuses) is the
                # worker's error: torch's queue fails in its feeder thread and main waits forever.
                outbox.answer("error", idx, _utils.ExceptionWrapper(where="in DataLoader worker process {}".format(
                    worker_id)))
            del data, index, msg
    except (KeyboardInterrupt, _MainGone):
        pass  # main raises the first; the second leaves nobody to tell
    finally:
        try:
            heap_scope.end()  # before its producer goes
        except Exception:
            pass
        try:
            if outbox.orphaned:
                outbox.main.wait_exited(_utils.MP_STATUS_CHECK_INTERVAL)  # then leaving removes the group
            outbox.close()
        except Exception:
            pass


# ---------------------------------------------------------------------------------------------
# Main side


# At exit a worker still busy in the dataset's code (it reads "stop" only between tasks) is
# terminated after this long, and main removes what it left. torch's loader does nothing at exit
# and multiprocessing terminates its workers at once: Ctrl-C to main alone took 0.16 s there,
# and 5.2 s here when a worker was stuck in __getitem__.
_EXIT_PATIENCE = 0.5


def _shutdown_at_exit(ref):
    it = ref()
    if it is not None:
        it._shutdown_workers(patience=_EXIT_PATIENCE)


class _ShmLoaderIter(_BaseDataLoaderIter):
    """torch's _MultiProcessingDataLoaderIter, receiving over tdshm."""

    def __init__(self, loader):
        super().__init__(loader)
        assert self._num_workers > 0 and self._prefetch_factor > 0
        ctx = loader.multiprocessing_context
        if ctx is None:
            import multiprocessing as ctx
        self._worker_init_fn = loader.worker_init_fn
        if isinstance(self._dataset, (_data.IterDataPipe, _data.MapDataPipe)):
            from torch.utils.data.dataloader import _sharding_worker_init_fn
            self._worker_init_fn = functools.partial(_sharding_worker_init_fn, self._worker_init_fn,
                                                     self._world_size, self._rank)
        self._shutdown = False
        self._ended = None  # why the iterator ended with tasks outstanding
        self._worker_pids_set = False
        stem = "dl-{}-{}".format(os.getpid(), uuid.uuid4().hex[:12])
        # Main's waits: `timeout` (torch: 0 = forever), Ctrl-C and torch's SIGCHLD handler answered
        # every 100 ms (the feed runs Python's signal handlers while it waits).
        self._feed = FeedConsumer(stem, self._num_workers, spin=_MAIN_SPIN, first_heap_bytes=256 << 10,
                                  timeout=timedelta(seconds=self._timeout) if self._timeout > 0 else None)
        self._tasks = []
        self._rings = []
        self._workers = []
        # A forked worker shares an anonymous mapping with main: its TaskRing. Unread messages
        # are at most the tasks in flight (prefetch_factor x num_workers, all to one worker once
        # the others' datasets ended) and a resume and a stop.
        ring_slots = self._prefetch_factor * self._num_workers + 8
        forked = ctx.get_start_method() == "fork"
        for i in range(self._num_workers):
            task_r, task_w = ctx.Pipe(duplex=False)
            ring_memory = mmap.mmap(-1, TaskRing.bytes_for(ring_slots)) if forked else None
            self._rings.append(None if ring_memory is None else TaskRing(ring_memory, ring_slots, True))
            w = ctx.Process(
                target=_worker_main,
                args=(self._dataset_kind, self._dataset, task_r, self._auto_collation, self._collate_fn,
                      self._drop_last, self._base_seed, self._worker_init_fn, i, self._num_workers,
                      self._prefetch_factor, stem, os.getpid(), ring_memory, ring_slots))
            w.daemon = True
            w.start()
            task_r.close()
            self._feed.watch(i, w.pid)
            self._tasks.append(task_w)
            self._workers.append(w)
        _utils.signal_handling._set_worker_pids(id(self), tuple(w.pid for w in self._workers))
        _utils.signal_handling._set_SIGCHLD_handler()
        self._worker_pids_set = True
        # At the interpreter's exit (a worker's error raised out of the program, say), before
        # multiprocessing's own handler, registered earlier, terminates the workers where they
        # stand (SIGTERM: no worker leaves its group) and this iterator may never be collected:
        # ended as at the end of an epoch, so nothing is left in /dev/shm.
        self._at_exit = functools.partial(_shutdown_at_exit, weakref.ref(self))
        atexit.register(self._at_exit)
        self._reset(loader, first_iter=True)

    def __next__(self):
        # torch's __next__ wraps every batch in a profiler record, 3-6 µs of main's 25 here: it is
        # seen only while a profiler runs, so it runs only then. Iterable datasets (whose length
        # warning torch's __next__ gives) and the rest take torch's own path.
        if (self._sampler_iter is None or self._dataset_kind == _DatasetKind.Iterable
                or torch.autograd._profiler_enabled()):
            return super().__next__()
        data = self._next_data()
        self._num_yielded += 1
        return data

    # ---- the order of tasks and answers (torch's) ----

    def _reset(self, loader, first_iter=False):
        super()._reset(loader, first_iter)
        self._send_idx = 0
        self._rcvd_idx = 0
        self._task_worker = {}
        self._workers_status = [True] * self._num_workers
        self._worker_queue_idx_cycle = itertools.cycle(range(self._num_workers))
        # Tasks not sent yet, per worker: the first prefetch_factor of each go in one write; every
        # later one at once, as torch's do (held back to pair them, a worker that is done waits
        # for work while main waits for it: 14 % fewer whole batches a second).
        self._unsent = [[] for _ in range(self._num_workers)]
        if not first_iter:
            # Persistent workers: each answers what it was still asked, then acknowledges.
            for w in range(self._num_workers):
                self._tell(w, ("resume",))
            for w in range(self._num_workers):
                while self._receive(w)[0] != "resumed":
                    pass
        for _ in range(self._prefetch_factor * self._num_workers):
            self._try_put_index(send=False)
        for w in range(self._num_workers):
            self._flush_tasks(w)

    def _flush_tasks(self, worker):
        if self._unsent[worker]:
            self._tell(worker, ("tasks", self._unsent[worker]))
            self._unsent[worker] = []

    def _tell(self, worker, msg):
        data = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
        ring = self._rings[worker]
        if ring is not None and ring.put(data):
            return
        try:
            _write(self._tasks[worker].fileno(), data)
        except OSError:
            pass  # the worker died (its end of the pipe closed): waiting for its answer says so

    def _try_put_index(self, send=True):
        # Every batch passes here, in main, whose CPU time bounds the loader's rate on a busy
        # machine (it gets its share of the CPUs, as each worker does): as few Python calls as
        # torch's steps allow.
        try:
            index = next(self._sampler_iter)  # torch's _next_index
        except StopIteration:
            return
        status = self._workers_status
        for _ in range(self._num_workers):
            worker = next(self._worker_queue_idx_cycle)
            if status[worker]:
                break
        else:
            return  # no worker left
        idx = self._send_idx
        if send:
            ring = self._rings[worker]
            if ring is None or not ring.put_task(idx, index):  # an int index: no pickle
                self._tell(worker, ("tasks", [(idx, index)]))
        else:
            self._unsent[worker].append((idx, index))
        self._task_worker[idx] = worker
        self._send_idx = idx + 1

    def _next_data(self):
        while True:
            while self._rcvd_idx < self._send_idx:
                worker = self._task_worker[self._rcvd_idx]
                if self._workers_status[worker]:
                    break
                # A task of a worker whose dataset ended: its answer ("stop") is read at the
                # next reset, or never.
                del self._task_worker[self._rcvd_idx]
                self._rcvd_idx += 1
            else:
                if not self._persistent_workers:
                    self._shutdown_workers()
                raise StopIteration
            kind, idx, data = self._receive(worker)
            assert idx == self._rcvd_idx, (idx, self._rcvd_idx)
            del self._task_worker[idx]
            self._rcvd_idx += 1
            if kind == "stop":
                self._workers_status[worker] = False
                self._try_put_index()
                continue
            self._try_put_index()
            if kind == "error":
                data.reraise()
            if self._pin_memory:
                data = _utils.pin_memory.pin_memory(data, self._pin_memory_device)
            return data

    # ---- receiving ----

    def _lost(self, worker, cause):
        """Raises torch's error for a worker that died or left (torch's own message when its
        SIGCHLD handler names it), after ending the iterator's workers (nothing is left in
        /dev/shm)."""
        try:
            if self._worker_pids_set:
                _utils.signal_handling._error_if_any_worker_fails()  # "... is killed by signal: ..."
        except RuntimeError:
            self._shutdown_workers()
            raise
        w = self._workers[worker]
        w.join(0.1)
        self._ended = "DataLoader worker (pid {}) was lost".format(w.pid)
        self._shutdown_workers()
        if not w.is_alive() and w.exitcode is not None and w.exitcode < 0:
            import signal
            raise RuntimeError("DataLoader worker (pid {}) is killed by signal: {}".format(
                w.pid, signal.strsignal(-w.exitcode))) from cause
        raise RuntimeError("DataLoader worker (pid(s) {}) exited unexpectedly: {}".format(w.pid, cause)) from cause

    def _receive(self, worker):
        """The next answer of `worker`: (kind, task index, batch / ExceptionWrapper / worker id)."""
        if self._shutdown:
            # Ended with tasks outstanding (a timeout, a worker lost): say so, not "exited".
            raise RuntimeError("this DataLoader iterator has ended ({}); iter(loader) starts a new one".format(
                self._ended or "its workers were shut down"))
        try:
            answer = self._feed.next_answer(worker, _unpickle)  # (kind, task index, body)
        except (TimeoutError, RuntimeError) as e:
            self._receive_failed(worker, e)
        # Ctrl-C (KeyboardInterrupt, raised within 0.1 s) leaves the workers to the iterator's
        # end, as torch's does: a terminal's Ctrl-C reaches them too, and they exit at once.
        if answer is None:
            self._lost(worker, EOFError("the worker closed its feed"))
        return answer

    def _receive_failed(self, worker, e):
        """Raises torch's error for a receive from `worker` that raised `e`."""
        if isinstance(e, TimeoutError):
            # The receive was withdrawn: this worker's answers are out of step from here. Its worker
            # is most likely stuck (that is why it timed out): not waited for, or the error came
            # 5 s after the timeout.
            self._ended = "DataLoader timed out after {} seconds".format(self._timeout)
            self._shutdown_workers(patience=0.1)
            raise RuntimeError(self._ended) from None
        if "DataLoader worker" in str(e):  # torch's SIGCHLD handler, run while main waited
            self._shutdown_workers()
            raise e
        self._lost(worker, e)

    # ---- shutting down ----

    def _shutdown_workers(self, patience=_utils.MP_STATUS_CHECK_INTERVAL):
        """Ends the workers: each has `patience` seconds in all to leave, then is terminated."""
        if self._shutdown:
            return
        self._shutdown = True
        if getattr(self, "_at_exit", None) is not None:
            atexit.unregister(self._at_exit)
        if self._worker_pids_set:
            _utils.signal_handling._remove_worker_pids(id(self))
            self._worker_pids_set = False
        # "stop" first, then leaving the feed: that ends a worker's wait on main (a put main will
        # never take, or its first group, which main refuses), and the worker then reads the stop
        # in its check.
        for worker in range(len(self._tasks)):
            try:
                self._tell(worker, ("stop",))
            except RuntimeError:
                pass  # its ring is full: it reads none of it, and is ended below
        self._feed.shutdown()
        give_up = time.monotonic() + patience
        for w in self._workers:
            w.join(max(0.0, give_up - time.monotonic()))
            if w.is_alive():
                w.terminate()
                w.join(_utils.MP_STATUS_CHECK_INTERVAL)
            if w.is_alive():  # it ignores SIGTERM (or is stuck in a call that blocks it)
                w.kill()
                w.join()
        # What a worker that died without leaving its group left behind (the views main holds
        # keep their mapping).
        self._feed.shutdown()
        for tasks in self._tasks:
            tasks.close()

    def __del__(self):
        try:
            self._shutdown_workers()
        except Exception:
            pass


class DataLoader(_data.DataLoader):
    """torch.utils.data.DataLoader (torch 1.13's arguments and semantics), whose workers hand
    batches to the main process through shared memory: the default collate stacks samples into
    the worker's shared heap and main receives views of it, no copy (docs/loader.md).
    ``num_workers=0`` is torch's single-process loading unchanged. ``pin_memory`` pins each batch
    in main when CUDA is available, as torch does; without CUDA it does nothing (torch's
    behaviour)."""

    def _get_iterator(self):
        if self.num_workers == 0:
            return super()._get_iterator()
        return _ShmLoaderIter(self)

    def __iter__(self):
        # Persistent workers ended by a timeout or a lost worker: the next epoch gets new ones
        # (torch's would reset the ended iterator, whose every receive then fails).
        ended = self.__dict__.get("_iterator")
        if isinstance(ended, _ShmLoaderIter) and ended._shutdown:
            self._iterator = None
        return super().__iter__()
