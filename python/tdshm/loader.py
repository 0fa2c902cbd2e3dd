"""tdshm.DataLoader: torch's DataLoader whose workers hand batches to the main process through
shared memory, zero copy (docs/loader.md).

The constructor, the sampling, the order of the batches, the worker seeds, get_worker_info() and
the failures are torch 1.13's: this class *is* a torch.utils.data.DataLoader, and only its
multi-process iterator differs. How a batch travels:

* main sends each worker its tasks (the sampler's indices, pickled) through a pipe, as torch's
  index queues do;
* each worker answers every task exactly once, in order, over its own two-rank shm group with
  main (a private segment, never the user's default group): a header (the batch pickled with
  every tensor left out) and then each tensor as its own message. A tensor in the worker's loan
  heap goes by reference and main receives a view of it, no copy; the default collate stacks the
  samples straight into loans, and any other tensor is copied into one (or, when the heap is
  full because main holds earlier batches, sent by value: never a wait, never an overwrite);
* the heap is sized from the worker's first batch, so before its first answer a worker speaks
  through a second pipe: the group's name and heap size, or an answer that carries no tensors
  (an exception, the end of an iterable dataset).

A batch's views give their bytes back when the batch is dropped; `list(loader)` or a batch kept
past the next step only keeps its worker's heap busy (later batches then travel by value).
"""

import itertools
import os
import pickle
import random
import time
import uuid
from datetime import timedelta

import torch
import torch.utils.data as _data
from torch.utils.data import _utils
from torch.utils.data._utils import collate as _collate
from torch.utils.data._utils import worker as _worker
from torch.utils.data.dataloader import _BaseDataLoaderIter, _DatasetKind

from ._C import ProcessGroupShm

__all__ = ["DataLoader"]

_TAG = 7  # every message of a worker's group uses one tag: they match in order
_SLICE = 0.1  # seconds between checks for dead workers while main waits on a pipe
_WATCH = 0.5  # seconds between a worker's checks that main still runs
_PAGE = 4096
_LEAF_SLACK = 256  # bytes of heap per tensor beyond its own (the allocator's alignment)
_HEAP_BATCHES = 4  # batches beyond the prefetched ones a heap holds (batches held, fragmentation)
_SPIN_US = 20
_FOREVER = timedelta(days=365)


def _group(name, rank, timeout, heap, tickets):
    """A worker's group with main: its heap, 8 arena slots of 64 KiB a rank (batches travel in
    loans; a slot carries a header or a tensor sent by value) and a small collective window (none
    runs), so that 8 workers with batches of 1.5 MiB fit a 64 MiB /dev/shm. A short spin: the
    workers need the CPUs main would spin on."""
    return ProcessGroupShm(name, rank, 2, timeout=timeout, loan_bytes=heap, loan_tickets=tickets,
                           spin=timedelta(microseconds=_SPIN_US), slots_per_rank=8, window_bytes=64 << 10)


class _MainGone(Exception):
    """The main process died or left the worker's group: the worker ends."""


def _is_timeout(e):
    # tdshm's TimeoutError reaches Python as a RuntimeError from ProcessGroupShm's own calls.
    text = str(e)
    return isinstance(e, TimeoutError) or "timed out" in text or "within the timeout" in text


def _main_left(e):
    text = str(e)
    return "left the group" in text or "is gone" in text or "was destroyed" in text


class _HeaderPickler(pickle.Pickler):
    def __init__(self, file, leaves):
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self._leaves = leaves

    def persistent_id(self, obj):
        if isinstance(obj, torch.Tensor):
            self._leaves.append(obj)
            return len(self._leaves) - 1
        return None


class _HeaderUnpickler(pickle.Unpickler):
    def __init__(self, file, leaves):
        super().__init__(file)
        self._leaves = leaves

    def persistent_load(self, pid):
        return self._leaves[pid]


def _split(obj):
    """(header bytes, tensors): `obj` pickled with every tensor replaced by its index."""
    import io
    leaves = []
    buf = io.BytesIO()
    _HeaderPickler(buf, leaves).dump(obj)
    return buf.getvalue(), leaves


def _join(header, leaves):
    import io
    return _HeaderUnpickler(io.BytesIO(header), leaves).load()


# ---------------------------------------------------------------------------------------------
# Worker side


class _Outbox:
    """A worker's answers to main: through its pipe until the shm group exists, then the group."""

    def __init__(self, conn, name, prefetch, timeout, parent):
        self.conn = conn
        self.name = name
        self.prefetch = prefetch
        self.timeout = timeout
        self.parent = parent
        self.pg = None
        self.tickets = 0
        self.works = []  # sends by value and headers, until they are all in the group's slots
        self.lent = []  # sends of loans not completed: each holds a ticket until main drops its view

    def _open(self, leaves):
        need = sum(t.numel() * t.element_size() + _LEAF_SLACK for t in leaves)
        heap = max(1 << 20, (self.prefetch + _HEAP_BATCHES) * need)
        heap = (heap + _PAGE - 1) // _PAGE * _PAGE
        tickets = max(64, (self.prefetch + _HEAP_BATCHES) * max(1, len(leaves)) * 2)
        self.tickets = tickets
        self.conn.send(("group", self.name, heap, tickets))
        # Main attaches when it needs this worker's answer, which may be long; it may also die
        # first. So the rendezvous is tried in slices, and given up once main is gone.
        while True:
            try:
                self.pg = _group(self.name, 1, timedelta(seconds=_WATCH * 4), heap, tickets)
                break
            except (TimeoutError, RuntimeError) as e:
                if not _is_timeout(e):
                    raise
                if os.getppid() != self.parent:
                    raise _MainGone() from None

    def loan_like(self, shape, dtype):
        """A tensor in the heap, or None (no group yet, or no room)."""
        return None if self.pg is None else self.pg.try_loan(list(shape), dtype)

    def answer(self, kind, idx, payload):
        """kind: "data" (payload: the batch), "error" (an ExceptionWrapper), "stop", "resumed".
        Raises _MainGone once main left the group (it shut the iterator down) or died."""
        try:
            self._answer(kind, idx, payload)
        except RuntimeError as e:
            if _main_left(e) or os.getppid() != self.parent:
                raise _MainGone() from None
            raise

    def _answer(self, kind, idx, payload):
        if kind != "data":
            if self.pg is None:
                self.conn.send((kind, idx, payload))
            else:
                self._send_header(pickle.dumps((kind, idx, payload, 0), protocol=pickle.HIGHEST_PROTOCOL))
            return
        header, leaves = _split(payload)
        if self.pg is None:
            self._open(leaves)
        self._send_header(pickle.dumps(("data", idx, header, len(leaves)), protocol=pickle.HIGHEST_PROTOCOL))
        pg = self.pg
        # A loan's Work holds its tensor, and so its heap bytes, until dropped: keep only those
        # whose views main still holds.
        self.lent = [w for w in self.lent if not w.is_completed()]
        for t in leaves:
            # A loan's send waits for a free ticket: with every ticket held by main's views, by
            # value instead (the heap's bytes are then held too, and try_loan says so).
            ticket = self._ticket_free()
            if ticket and t.is_contiguous() and pg.is_loan(t):
                out = t
            else:
                out = pg.try_loan(list(t.shape), t.dtype) if ticket else None
                if out is None:
                    out = t.clone() if pg.is_loan(t) or not t.is_contiguous() else t  # by value
                else:
                    out.copy_(t)
            work = pg.send([out], 0, _TAG)
            (self.lent if pg.is_loan(out) else self.works).append(work)
        self._flush()

    def _send_header(self, data):
        self.works.append(self.pg.send([torch.frombuffer(bytearray(data), dtype=torch.uint8)], 0, _TAG))
        self._flush()

    def _ticket_free(self):
        return len(self.lent) + 1 < self.tickets

    def _flush(self):
        # A message sent by value streams through the group's slots only while this process
        # calls into tdshm: wait until it is all in (at once, unless main holds every slot; then
        # main takes it when it reaches this batch). Main's death or departure ends the wait.
        for w in self.works:
            w.wait(_FOREVER)
        self.works = []

    def close(self):
        self.works = []
        self.lent = []
        self.pg = None


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


def _worker_main(dataset_kind, dataset, tasks, answers, auto_collation, collate_fn, drop_last, base_seed,
                 init_fn, worker_id, num_workers, prefetch, name, timeout_s, parent):
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
        outbox = _Outbox(answers, name, prefetch, timedelta(seconds=timeout_s), parent)
        if collate_fn is _collate.default_collate:
            fn_map = _loan_collate_fn_map(outbox)
            collate_fn = lambda batch: _collate.collate(batch, collate_fn_map=fn_map)  # noqa: E731

        def make_fetcher():
            return _DatasetKind.create_fetcher(dataset_kind, dataset, auto_collation, collate_fn, drop_last)

        init_exception = None
        fetcher = None
        try:
            if init_fn is not None:
                init_fn(worker_id)
            fetcher = make_fetcher()
        except Exception:
            init_exception = _utils.ExceptionWrapper(where="in DataLoader worker process {}".format(worker_id))
        iteration_end = False
        while True:
            # Main gone (killed, or it exited without closing us): end within _WATCH seconds.
            while not tasks.poll(_WATCH):
                if os.getppid() != parent:
                    return
            try:
                msg = tasks.recv()
            except EOFError:
                return
            kind = msg[0]
            if kind == "stop":
                return
            if kind == "resume":
                iteration_end = False
                try:
                    fetcher = make_fetcher()
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
                data = fetcher.fetch(index)
            except Exception as e:
                if isinstance(e, StopIteration) and dataset_kind == _DatasetKind.Iterable:
                    iteration_end = True
                    outbox.answer("stop", idx, worker_id)
                else:
                    outbox.answer("error", idx,
                                  _utils.ExceptionWrapper(where="in DataLoader worker process {}".format(worker_id)))
                continue
            outbox.answer("data", idx, data)
            del data, index, msg
    except (KeyboardInterrupt, _MainGone):
        pass  # main raises the first; the second leaves nobody to tell
    finally:
        try:
            outbox.close()
        except Exception:
            pass


# ---------------------------------------------------------------------------------------------
# Main side


class _Channel:
    """Main's end of one worker: its pipes, then its group."""

    def __init__(self, tasks, answers):
        self.tasks = tasks
        self.answers = answers
        self.pg = None


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
            import functools
            from torch.utils.data.dataloader import _sharding_worker_init_fn
            self._worker_init_fn = functools.partial(_sharding_worker_init_fn, self._worker_init_fn,
                                                     self._world_size, self._rank)
        self._shutdown = False
        self._worker_pids_set = False
        # The workers' side of each group: its rendezvous waits for main to need that worker,
        # however long the user's loop takes. Main's side waits `timeout` (torch: 0 = forever).
        self._group_timeout = timedelta(days=365)
        stem = "dl-{}-{}".format(os.getpid(), uuid.uuid4().hex[:12])
        self._channels = []
        self._workers = []
        for i in range(self._num_workers):
            task_r, task_w = ctx.Pipe(duplex=False)
            ans_r, ans_w = ctx.Pipe(duplex=False)
            w = ctx.Process(
                target=_worker_main,
                args=(self._dataset_kind, self._dataset, task_r, ans_w, self._auto_collation, self._collate_fn,
                      self._drop_last, self._base_seed, self._worker_init_fn, i, self._num_workers,
                      self._prefetch_factor, "{}-w{}".format(stem, i), self._group_timeout.total_seconds(),
                      os.getpid()))
            w.daemon = True
            w.start()
            task_r.close()
            ans_w.close()
            self._channels.append(_Channel(task_w, ans_r))
            self._workers.append(w)
        _utils.signal_handling._set_worker_pids(id(self), tuple(w.pid for w in self._workers))
        _utils.signal_handling._set_SIGCHLD_handler()
        self._worker_pids_set = True
        self._reset(loader, first_iter=True)

    # ---- the order of tasks and answers (torch's) ----

    def _reset(self, loader, first_iter=False):
        super()._reset(loader, first_iter)
        self._send_idx = 0
        self._rcvd_idx = 0
        self._task_worker = {}
        self._workers_status = [True] * self._num_workers
        self._worker_queue_idx_cycle = itertools.cycle(range(self._num_workers))
        if not first_iter:
            # Persistent workers: each answers what it was still asked, then acknowledges.
            for ch in self._channels:
                ch.tasks.send(("resume",))
            for w in range(self._num_workers):
                while self._receive(w)[0] != "resumed":
                    pass
        for _ in range(self._prefetch_factor * self._num_workers):
            self._try_put_index()

    def _try_put_index(self):
        try:
            index = self._next_index()
        except StopIteration:
            return
        for _ in range(self._num_workers):
            worker = next(self._worker_queue_idx_cycle)
            if self._workers_status[worker]:
                break
        else:
            return  # no worker left
        self._channels[worker].tasks.send(("task", self._send_idx, index))
        self._task_worker[self._send_idx] = worker
        self._send_idx += 1

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

    def _deadline(self):
        return None if self._timeout <= 0 else time.monotonic() + self._timeout

    def _check(self, worker, deadline, cause=None):
        """Raises torch's errors: a worker killed or gone, or the loader's timeout. A lost worker
        ends the iterator's workers and groups first (nothing is left in /dev/shm)."""
        try:
            if self._worker_pids_set:
                _utils.signal_handling._error_if_any_worker_fails()  # "... is killed by signal: ..."
        except RuntimeError:
            self._shutdown_workers()
            raise
        w = self._workers[worker]
        if not w.is_alive():
            self._shutdown_workers()
            raise RuntimeError("DataLoader worker (pid(s) {}) exited unexpectedly".format(w.pid)) from cause
        if deadline is not None and time.monotonic() >= deadline:
            raise RuntimeError("DataLoader timed out after {} seconds".format(self._timeout))
        if cause is not None:
            raise RuntimeError("DataLoader worker (pid {}): {}".format(w.pid, cause)) from cause

    def _wait(self, receive, worker):
        # One blocking wait: the group's timeout is the loader's, and tdshm sees a worker that
        # died (or left) within its peer check (0.1 s). A wait cannot be sliced: a p2p wait that
        # times out withdraws its receive.
        try:
            return receive()
        except Exception as e:
            if _is_timeout(e):
                # The receive was withdrawn: this worker's answers are out of step from here.
                self._shutdown_workers()
                raise RuntimeError("DataLoader timed out after {} seconds".format(self._timeout)) from None
            self._check(worker, None, e)
            raise

    def _receive(self, worker):
        """The next answer of `worker`: (kind, task index, batch / ExceptionWrapper / worker id)."""
        ch = self._channels[worker]
        deadline = self._deadline()
        if ch.pg is None:
            while not ch.answers.poll(_SLICE):
                self._check(worker, deadline)
            try:
                msg = ch.answers.recv()
            except EOFError as e:
                self._check(worker, None, e)
                raise
            if msg[0] != "group":
                return msg
            _, name, heap, tickets = msg
            wait = timedelta(seconds=self._timeout) if self._timeout > 0 else self._group_timeout
            ch.pg = _group(name, 0, wait, heap, tickets)
        pg = ch.pg
        header = self._wait(lambda: pg.recv_view(1, _TAG), worker)
        kind, idx, body, n = pickle.loads(header.numpy().tobytes())
        if kind != "data":
            return kind, idx, body
        return kind, idx, _join(body, self._wait(lambda: pg.recv_views(1, _TAG, n), worker))

    # ---- shutting down ----

    def _shutdown_workers(self):
        if self._shutdown:
            return
        self._shutdown = True
        if self._worker_pids_set:
            _utils.signal_handling._remove_worker_pids(id(self))
            self._worker_pids_set = False
        for ch in self._channels:
            # Leaving the group first ends a worker's wait on main (a send main will never
            # take); then the pipe tells it to stop.
            if ch.pg is not None:
                ch.pg.shutdown()
            try:
                ch.tasks.send(("stop",))
            except (BrokenPipeError, OSError):
                pass
        give_up = time.monotonic() + _utils.MP_STATUS_CHECK_INTERVAL
        for worker, w in enumerate(self._workers):
            ch = self._channels[worker]
            # A worker that announced its group waits for main in the group's rendezvous:
            # join it so that the worker can leave (and the segment goes with the last rank).
            while w.is_alive() and time.monotonic() < give_up:
                if ch.pg is None and ch.answers.poll(0.01):
                    try:
                        msg = ch.answers.recv()
                    except (EOFError, OSError):
                        continue
                    if msg[0] == "group":
                        _, name, heap, tickets = msg
                        try:
                            ch.pg = _group(name, 0, timedelta(seconds=5), heap, tickets)
                        except Exception:
                            pass
                else:
                    w.join(0.01)
            if w.is_alive():
                w.terminate()
                w.join()
        for ch in self._channels:
            if ch.pg is not None:
                # Left the segment above, or joined it meanwhile: leave now, whoever still
                # refers to the group (a traceback); the views main holds keep their mapping.
                ch.pg.shutdown()
            ch.pg = None
            ch.tasks.close()
            ch.answers.close()

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
