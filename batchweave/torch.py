"""PyTorch integration: a DataLoader-ready dataset and a checkpointable loader.

:class:`WeaveDataset` is an ``IterableDataset`` of ``(step, data)`` for one training rank. Under
a ``DataLoader`` with ``num_workers=W`` worker ``w`` reads steps ``w, w + W, ...`` (its consumer
has ``stride=W``), and the DataLoader's in-order round robin over workers puts them back into
step order: the sequence is the same for any number of workers, and each step is read once.
Each item already is one step's batch: in a plain ``DataLoader`` pass ``batch_size=None``; any
batch size batches inside each worker, whose steps are strided (``[0, W], [1, W + 1], ...``).

:class:`WeaveLoader` wraps the ``DataLoader`` and implements torch's ``Stateful`` protocol: its
:meth:`~WeaveLoader.state_dict` records the step after the last one it yielded, so steps that
workers prefetched but the loop never saw do not count, and :meth:`~WeaveLoader.load_state_dict`
resumes there (with any number of workers). Requires ``torch`` (``pip install batchweave[torch]``).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import inspect
import math
import multiprocessing
import os
import pickle
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Generator, Iterator, Mapping
from typing import Any, ClassVar

import numpy as np

try:
    import torch
    from torch.utils.data import DataLoader, IterableDataset, default_convert, get_worker_info
except ImportError as exc:
    raise ImportError(
        f"batchweave.torch needs PyTorch ({exc}): pip install 'batchweave[torch]'",
        name=exc.name,
    ) from exc

from batchweave._checks import as_count, as_seconds, check_namespace
from batchweave._consumer import Consumer
from batchweave._consumer._options import check_options, resolve_coordinates
from batchweave._errors import ConsumerError, ConsumerTimeout, NamespaceNotFound
from batchweave._mesh import Mesh
from batchweave._projection import DEFAULT_RANK_ORDER
from batchweave._store._base import ObjectStore
from batchweave._store._memory import MemoryStore
from batchweave._store._obstore import ObstoreS3Store
from batchweave._store._open import check_store_url, open_store, store_url_scheme
from batchweave._store._wrappers import StoreWrapper

__all__ = ["WeaveDataset", "WeaveLoader", "to_tensors"]

_default_convert: Callable[[Any], Any] = default_convert  # untyped in torch

_LOADER_OWNED = ("batch_size", "shuffle", "sampler", "batch_sampler", "drop_last")

_CONSUMER_PARAMETERS = frozenset(inspect.signature(Consumer).parameters)

_OBSTORE_FORK_ADVICE = (
    "obstore is not fork-safe (the threads of its runtime do not survive fork(), so a forked "
    "worker of a process that used obstore hangs in its first request); start the workers "
    "with multiprocessing_context='forkserver' or 'spawn' (WeaveLoader's default for an obstore "
    "store), or read with the boto3 client (s3_client='boto3')"
)
"""Why a ``fork`` start method is refused for workers reading with obstore."""

_MAX_WORKER_TIMEOUT = 2_147_483.0
"""The longest DataLoader ``timeout`` with workers, in s: torch waits for their steps on
``multiprocessing.connection.wait``, whose ``poll``/``epoll`` takes whole milliseconds in a C
``int`` (``2**31 - 1`` ms); threading's ``TIMEOUT_MAX`` is larger on every platform."""

_STOP_POLL = 0.05
"""How often a DataLoader worker waiting for producers checks whether it should stop, in s."""


def to_tensors(item: Any) -> Any:
    """:class:`WeaveLoader`'s default ``collate_fn``: numpy arrays become tensors the loop owns.

    ``WeaveLoader`` calls it with each step's data, a plain ``DataLoader`` with the whole
    ``(step, data)`` item (the step stays an ``int``).

    Decoded arrays are read-only views of the read buffer (for large slices on ``file://``, of a
    read-only memory map), and a tensor cannot be read-only: an in-place op on a tensor viewing
    such a map kills the process with SIGSEGV. So in the main process (``num_workers=0``)
    read-only arrays are copied first. In a DataLoader worker they are converted without a copy:
    sending a tensor to the main process moves it into shared memory, which is a copy already.
    Everything else is left as ``torch.utils.data.default_convert`` leaves it.
    """
    if get_worker_info() is None:
        return _default_convert(_writable(item))
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "The given NumPy array is not writable", UserWarning)
        return _default_convert(item)


def _writable(item: Any) -> Any:
    """``item`` with every read-only numpy array (in dicts, lists and tuples) replaced by a copy.

    Containers are rebuilt as ``default_convert`` rebuilds them, keeping their type: a dict
    subclass as an updated copy, a namedtuple from its fields (``type(item)(*values)``: it takes
    no iterable); one that cannot be rebuilt so becomes a plain dict or list.
    """
    if isinstance(item, np.ndarray):
        return item if item.flags.writeable else item.copy()
    if isinstance(item, dict):
        entries = {key: _writable(value) for key, value in item.items()}
        if type(item) is dict:
            return entries
        try:
            clone = copy.copy(item)
            clone.update(entries)
            return clone
        except TypeError:
            return entries
    if isinstance(item, tuple) and hasattr(item, "_fields"):  # a namedtuple
        return type(item)(*(_writable(value) for value in item))
    if isinstance(item, list | tuple):
        values = [_writable(value) for value in item]
        try:
            return type(item)(values)
        except TypeError:
            return values
    return item


class WeaveDataset(IterableDataset[tuple[int, Any]]):
    """One rank's ``(step, data)`` stream as an ``IterableDataset`` (see the module docstring).

    ``store`` is an :class:`ObjectStore` or a store URL; with worker processes prefer a URL,
    opened in each worker (read-only: no conditional-write probe) with ``store_options``. The
    rank's coordinates are resolved here, in the main process (explicit, or from
    ``RANK``/``WORLD_SIZE`` with ``tp``, ``pp`` and ``rank_order``) and checked against
    ``mesh`` with the consumer's own checks, so a rank outside the mesh, or a keyword argument
    :class:`Consumer` does not take or a value it refuses (``part_size=16e6``), fails here rather
    than when iteration starts, inside a DataLoader worker. So does a store URL or
    ``store_options`` entry ``open_store`` would refuse (``InvalidStoreURL``), checked without
    opening the store: no request, no credentials. Other keyword arguments go to every worker's
    :class:`Consumer` (``prefetch``, ``timeout``, ``split_threshold``, ...).
    """

    def __init__(
        self,
        store: ObjectStore | str,
        namespace: str,
        *,
        mesh: Mesh,
        dp_rank: int | None = None,
        cp_rank: int | None = None,
        tp: int = 1,
        pp: int = 1,
        rank_order: str = DEFAULT_RANK_ORDER,
        store_options: Mapping[str, Any] | None = None,
        **consumer_options: Any,
    ) -> None:
        super().__init__()
        for name in ("stride", "start_step"):
            if name in consumer_options:
                raise TypeError(
                    f"WeaveDataset sets the consumer's {name!r} itself; resume with "
                    "WeaveLoader.load_state_dict instead"
                )
        if "environ" in consumer_options:
            raise TypeError(
                "WeaveDataset takes no 'environ': it reads RANK and WORLD_SIZE from os.environ "
                "when dp_rank and cp_rank are not given. To use other values, pass dp_rank and "
                "cp_rank, e.g. from batchweave.coordinates_from_env(mesh, environ=...)"
            )
        unknown = sorted(set(consumer_options) - _CONSUMER_PARAMETERS)
        if unknown:
            raise TypeError(
                f"WeaveDataset got unknown consumer option(s) {', '.join(unknown)}; the keyword "
                "arguments it does not take itself go to batchweave.Consumer"
            )
        if not isinstance(store, str | ObjectStore):
            raise TypeError(
                f"store must be an opened store or a store URL, got the {type(store).__name__} "
                f"{store!r}; e.g. WeaveDataset('s3://bucket/prefix', ...)"
            )
        check_namespace(namespace)
        consumer_options = check_options(**consumer_options)
        self.store = store
        self.namespace = namespace
        self.mesh = mesh
        self.dp_rank, self.cp_rank = resolve_coordinates(
            mesh, dp_rank, cp_rank, tp=tp, pp=pp, order=rank_order, environ=None
        )
        self.store_options = dict(store_options or {})
        if isinstance(store, str):
            # What open_store would refuse in each worker, refused here; nothing is opened.
            check_store_url(store, **self.store_options)
        self.consumer_options = consumer_options
        self.resume_state: dict[str, Any] | None = None
        """Consumer state an iteration starts from (None: the first step). :class:`WeaveLoader`
        sets it on each iteration's own shallow copy of the dataset, never on this one."""
        self.stop_event: Any = None
        """A shared flag (a multiprocessing ``RawValue``) :class:`WeaveLoader` sets to 1 when its
        loop ends (or None).

        Workers waiting for producers poll it and then close their consumers at once: a worker
        waits at the head of the stream for as long as producers are behind, and torch waits 5 s
        for each worker that does not stop before killing it. A flag, not an ``Event``: setting
        an ``Event`` waits for every waiting process to acknowledge, for ever if one was killed.
        """
        self.default_timeout: float | None = None
        """The consumer's ``timeout`` when the dataset's options set none: :class:`WeaveLoader`
        sets its DataLoader ``timeout`` here when it runs no workers (torch takes it only with
        workers), on the iteration's own copy of the dataset."""
        self._loader_pid: int | None = None
        """The pid of the process whose :class:`WeaveLoader` iterates this (copy of the) dataset.

        Its workers stop once it is gone, also when it is not their parent (``forkserver``)."""
        self._namespace_id: str | None = None
        """The id of the namespace, as the consumer of an iteration in this process saw it."""

    @property
    def namespace_id(self) -> str | None:
        """The namespace's id once an iteration in this process delivered a step, else ``None``.

        Read from that iteration's consumer (no store request). Iterations in DataLoader worker
        processes keep theirs: with ``num_workers`` > 0 it stays ``None`` in the main process.
        """
        return self._namespace_id

    def open_store(self) -> tuple[ObjectStore, bool]:
        """The store to read, and whether the caller opened it (and must close it)."""
        if isinstance(self.store, str):
            store = open_store(self.store, verify_conditional_writes=False, **self.store_options)
            return store, True
        return self.store, False

    def consumer(
        self,
        store: ObjectStore,
        *,
        worker: int = 0,
        workers: int = 1,
        stop: Any = None,
        default_timeout: float | None = None,
    ) -> Consumer:
        """A consumer for DataLoader worker ``worker`` of ``workers``, at :attr:`resume_state`.

        With ``stop`` (a :attr:`stop_event` flag, or ``True`` for none), the consumer is made
        for a worker process: once the flag is set, or the process that started this one is
        gone, its next wait closes it instead. ``default_timeout`` is its ``timeout`` unless the
        dataset's options set one.
        """
        options = dict(self.consumer_options)
        if options.get("timeout") is None and default_timeout is not None:
            options["timeout"] = default_timeout
        made: list[Consumer] = []  # the consumer, once made, for the sleep to close
        if stop is not None:
            flag = None if stop is True else stop
            watch = _WorkerStop(flag, os.getppid(), self._loader_pid)
            options["sleep"] = functools.partial(
                _sleep_unless_stopped, watch, options.get("sleep"), made
            )
        consumer = Consumer(
            store,
            self.namespace,
            mesh=self.mesh,
            dp_rank=self.dp_rank,
            cp_rank=self.cp_rank,
            start_step=worker,
            stride=workers,
            **options,
        )
        made.append(consumer)
        if self.resume_state is not None:
            state = dict(self.resume_state)
            state["step"] = int(state["step"]) + worker
            consumer.load_state_dict(state)
        return consumer

    def __iter__(self) -> Iterator[tuple[int, Any]]:
        info = get_worker_info()
        worker, workers = (0, 1) if info is None else (info.id, info.num_workers)
        # In a worker, always watch the parent: with ``True`` (no loader flag) only the parent.
        stop = None if info is None else (True if self.stop_event is None else self.stop_event)
        store, owned = self.open_store()
        try:
            consumer = self.consumer(
                store,
                worker=worker,
                workers=workers,
                stop=stop,
                default_timeout=self.default_timeout,
            )
            with consumer:
                for item in consumer:
                    self._namespace_id = consumer.namespace_id
                    yield item
        finally:
            if owned:
                store.close()


class _WorkerStop:
    """Whether a DataLoader worker waiting for producers should give up: once the loader's loop
    ended (``flag``, a shared ``RawValue``, is set), or the training process is gone.

    Reading a flag needs nothing of the other processes, unlike a multiprocessing ``Event``,
    whose ``set()`` waits for every waiting process to acknowledge: for ever if one was killed.
    The training process is gone once ``os.getppid()`` is no longer ``parent`` (the worker's
    parent when it started: the training process with ``fork`` and ``spawn``), or once
    ``loader`` (the pid of the loader's process, if known) no longer runs: with ``forkserver``
    the parent is the fork server, which its children keep alive.
    """

    def __init__(self, flag: Any, parent: int, loader: int | None) -> None:
        self.flag = flag
        self.parent = parent
        self.loader = None if loader == parent else loader

    def stopped(self) -> bool:
        """Whether nobody will ask for the step this worker waits for."""
        return (self.flag is not None and bool(self.flag.value)) or self.orphaned()

    def orphaned(self) -> bool:
        """Whether the training process is gone."""
        if os.getppid() != self.parent:
            return True
        return self.loader is not None and not _runs(self.loader)


def _runs(pid: int) -> bool:
    """Whether process ``pid`` exists and is not a zombie (an exited process not reaped yet)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            state = stat.read().rpartition(b")")[2].split()[:1]
    except OSError:
        return True  # no procfs: it exists
    return state not in ([b"Z"], [b"X"])


def _sleep_unless_stopped(
    stop: _WorkerStop,
    sleep: Callable[[float], None] | None,
    consumers: list[Consumer],
    seconds: float,
) -> None:
    """A worker consumer's sleep: wakes early and closes the consumer once ``stop`` says so."""
    if sleep is None:
        deadline = time.monotonic() + seconds
        while not stop.stopped():
            left = deadline - time.monotonic()
            if left <= 0:
                return
            time.sleep(min(_STOP_POLL, left))
    else:
        sleep(seconds)
        if not stop.stopped():
            return
    # the loader's loop ended, or its process died: nobody will ask for the step it waits for
    for consumer in consumers:
        consumer.close()
    if stop.orphaned():
        # Leave torch's worker loop too: its own check of the parent misses a dead training
        # process under forkserver, and nothing else would end this process.
        raise SystemExit("batchweave: the training process is gone; this DataLoader worker exits")


def _start_method(context: Any) -> str:
    """The start method DataLoader workers get with ``multiprocessing_context=context``."""
    method = context if isinstance(context, str) or context is None else context.get_start_method()
    # Not get_start_method(): without allow_none it fixes the default, and a later
    # set_start_method() of the user's would fail. The first method listed is the default.
    return str(
        method
        or multiprocessing.get_start_method(allow_none=True)
        or multiprocessing.get_all_start_methods()[0]
    )


def _reads_with_obstore(dataset: WeaveDataset) -> bool:
    """Whether the dataset's store is an :class:`ObstoreS3Store` (maybe wrapped), or a URL
    opened with one (``store_options={"s3_client": "obstore"}``)."""
    store = dataset.store
    if isinstance(store, str):
        return (
            store_url_scheme(store) == "s3" and dataset.store_options.get("s3_client") == "obstore"
        )
    return isinstance(_innermost(store), ObstoreS3Store)


def _innermost(store: Any) -> Any:
    """The store at the end of ``store``'s chain of :class:`StoreWrapper` (``store`` if none)."""
    while isinstance(store, StoreWrapper):
        store = store.inner
    return store


def _obstore_worker_context(context: Any) -> Any:
    """The ``multiprocessing_context`` for workers reading with obstore: ``context`` if it does
    not fork, a context that does not fork if none was given; an explicit ``fork`` is refused.

    obstore is not fork-safe: the threads of its runtime stay in the parent, so a forked child
    of a process that used obstore (a loader whose ``state_dict()`` or ``load_state_dict()``
    read the manifest, say) hangs in its first request.
    """
    if _start_method(context) != "fork":
        return context
    if context is not None:
        raise ValueError(
            f"multiprocessing_context={context!r} forks the DataLoader workers, but the store "
            f"reads with obstore: {_OBSTORE_FORK_ADVICE}"
        )
    methods = multiprocessing.get_all_start_methods()
    return "forkserver" if "forkserver" in methods else "spawn"


def _check_store_reaches_workers(dataset: WeaveDataset, context: Any) -> None:
    """Refuse a store object that DataLoader worker processes cannot use, saying what works.

    A ``memory://`` store (also inside a :class:`StoreWrapper`) lives in one process: each
    worker would read its own copy, which no producer writes to. Workers started with
    ``spawn``/``forkserver`` receive the dataset pickled, which an S3 client (thread-local
    sessions, locks) does not survive; torch's own error names only the unpicklable attribute.
    """
    store = dataset.store
    if isinstance(_innermost(store), MemoryStore) or (
        isinstance(store, str) and store_url_scheme(store) == "memory"
    ):
        raise ValueError(
            "a memory:// store exists only in this process (also wrapped): DataLoader workers "
            "would each read a copy of their own, which no producer writes to; use "
            "num_workers=0, or a file:// or s3:// store"
        )
    if isinstance(store, str):
        return
    method = _start_method(context)
    if method == "fork":
        return  # forked workers inherit the store; nothing is pickled
    try:
        pickle.dumps(store)
    except Exception as exc:
        raise TypeError(
            f"the store {store!r} cannot be sent to DataLoader workers started with "
            f"{method!r} (pickling it failed: {exc}); "
            "pass the store URL instead, e.g. WeaveDataset('s3://bucket/prefix', ..., "
            "store_options={...}), and each worker opens its own client"
        ) from exc


def _loader_timeout(value: Any, workers: int) -> float:
    """The DataLoader ``timeout`` to use for ``value``: checked, and ``inf`` (no timeout) as 0.

    torch waits for a worker's step with a timeout of at most :data:`_MAX_WORKER_TIMEOUT` s (a
    longer one is an ``OverflowError`` at the first step), and takes 0 for none; without workers
    the value bounds the consumer's waits, where ``inf`` also means none.
    """
    timeout = as_seconds("timeout", value)
    if math.isinf(timeout):
        return 0.0
    if workers and timeout > _MAX_WORKER_TIMEOUT:
        raise ValueError(
            f"timeout must be at most {_MAX_WORKER_TIMEOUT:.0f} seconds (about 24 days) with "
            f"DataLoader workers, which cannot wait longer for a step; got {value!r}; pass "
            "timeout=float('inf') (or 0) for no timeout"
        )
    return timeout


def _check_dataloader_options(dataset: WeaveDataset, options: Mapping[str, Any]) -> None:
    """Refuse ``DataLoader`` options torch would refuse only when the first iteration makes its
    DataLoader (an unknown keyword, ``prefetch_factor`` without workers, an unknown
    ``multiprocessing_context``), or that would fail only at the first step (``generator=5``, a
    ``worker_init_fn`` or ``collate_fn`` that cannot be called): here, with torch's own message.

    One DataLoader is made with the same options and dropped: making one starts no worker and
    reads nothing (workers start when it is iterated).
    """
    generator = options.get("generator")
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(
            f"generator must be a torch.Generator or None, got the {type(generator).__name__} "
            f"{generator!r}"
        )
    for name in ("worker_init_fn", "collate_fn"):
        fn = options.get(name)
        if fn is not None and not callable(fn):
            raise TypeError(f"{name} must be callable or None, got the {type(fn).__name__} {fn!r}")
    try:
        with warnings.catch_warnings():  # torch's advice on num_workers comes with each iter()
            warnings.simplefilter("ignore")
            DataLoader(dataset, batch_size=None, **options)
    except (TypeError, ValueError) as exc:
        message = f"WeaveLoader: torch.utils.data.DataLoader refuses these options: {exc}"
        if isinstance(exc, TypeError):
            raise TypeError(message) from exc
        raise ValueError(message) from exc


class WeaveLoader:
    """Iterates a :class:`WeaveDataset` through a ``DataLoader``; checkpointable (``Stateful``).

    ``dataloader_options`` go to ``torch.utils.data.DataLoader`` (``num_workers``,
    ``pin_memory``, ``prefetch_factor``, ``collate_fn`` (default :func:`to_tensors`),
    ``multiprocessing_context``, ``timeout`` (``inf`` for none, as 0), ...). ``collate_fn`` is
    called with each step's data alone, and what it returns is the ``batch`` of ``for step, batch
    in loader``: the step goes around it. Each item already is one step's batch, so batching and
    sampling options are refused, as are
    ``persistent_workers`` (workers must restart at the resume step) and ``in_order=False``
    (delivery order is the step order). A new DataLoader is made per ``iter()``, which continues
    where the previous iteration stopped and replaces it: the older iterator's workers are shut
    down, and asking it for another step is a :class:`~batchweave.ConsumerError` (each step is
    delivered once; use a second loader for a separate pass).
    """

    _takes_consumer_states: ClassVar[bool] = True
    """``checkpoint_hook`` checks a ``state`` given with it on every rank (its states are
    consumer states)."""

    def __init__(self, dataset: WeaveDataset, **dataloader_options: Any) -> None:
        if not isinstance(dataset, WeaveDataset):
            raise TypeError(
                f"dataset must be a batchweave.torch.WeaveDataset, got the "
                f"{type(dataset).__name__} {dataset!r}"
            )
        # Checked here rather than by torch when the first iteration makes its DataLoader.
        if "num_workers" in dataloader_options:
            dataloader_options["num_workers"] = as_count(
                "num_workers", dataloader_options["num_workers"], 0
            )
        if "timeout" in dataloader_options:
            dataloader_options["timeout"] = _loader_timeout(
                dataloader_options["timeout"], dataloader_options.get("num_workers", 0)
            )
        if dataloader_options.get("prefetch_factor") is not None:
            dataloader_options["prefetch_factor"] = as_count(
                "prefetch_factor", dataloader_options["prefetch_factor"], 1
            )
        refused = [name for name in _LOADER_OWNED if name in dataloader_options]
        if refused:
            raise TypeError(
                f"WeaveLoader does not accept {', '.join(refused)}: every item is already one "
                "step's batch for this rank, in step order"
            )
        if dataloader_options.get("persistent_workers"):
            raise ValueError("persistent_workers cannot restart at a resumed step; leave it off")
        if dataloader_options.get("in_order", True) is not True:
            raise ValueError("in_order=False would deliver steps out of order; leave it on")
        options = {"collate_fn": to_tensors, **dataloader_options}
        if options.get("num_workers", 0) and _reads_with_obstore(dataset):
            context = _obstore_worker_context(options.get("multiprocessing_context"))
            if context is not None:
                options["multiprocessing_context"] = context
        _check_dataloader_options(dataset, options)
        if options.get("num_workers", 0):
            _check_store_reaches_workers(dataset, options.get("multiprocessing_context"))
        self.dataset = dataset
        self.dataloader_options = options
        self._next_step: int | None = None
        self._loops = 0
        """Iterations running now: a state loaded meanwhile would not reach their workers."""
        self._shadow_store: ObjectStore | None = None
        self._shadow: Consumer | None = None
        self._iterations = 0
        """Iterators made so far: only the newest one (this number) may deliver steps."""
        self._newest: weakref.ref[_LoaderIterator] | None = None
        self._lock = threading.Lock()
        """Makes a newer iterator and an older one's delivery of a step on another thread
        exclusive: the step is the older one's (the newer starts after it), or dropped."""

    def __iter__(self) -> Iterator[tuple[int, Any]]:
        """An iterator continuing where the last one stopped, which it replaces.

        Two live iterators would each deliver the steps from where they are: the same steps
        twice. So the newest is the only one: the one it replaces stops its workers now, and
        asking it for another step raises :class:`~batchweave.ConsumerError`.
        """
        with self._lock:  # an older iterator delivering a step on another thread waits
            older = None if self._newest is None else self._newest()
            if older is not None:
                older.replaced(self._next_step)
            self._iterations += 1
            newest = _LoaderIterator(self, self._iterations)
            self._newest = weakref.ref(newest)
        return newest

    def _iterate(self, number: int) -> Generator[tuple[int, Any], None, None]:
        """The steps of iteration ``number`` (see :class:`_LoaderIterator`).

        Raises :class:`_Replaced` for a step that arrives once a newer iteration exists (one
        thread waited for it while another made the newer iterator): the newer one delivers it.
        """
        # This iteration's own copy of the dataset: the user's is never modified, so another
        # loader (or DataLoader) over it still starts where the dataset does.
        dataset = copy.copy(self.dataset)
        if self._next_step is not None:
            dataset.resume_state = self.state_dict()
        stop = self._stop_event()
        dataset.stop_event = stop  # pickled into (or forked with) this iteration's workers
        dataset._loader_pid = os.getpid()
        options = dict(self.dataloader_options)
        if not options.get("num_workers", 0) and options.get("timeout"):
            # torch takes a timeout only with workers (its single-process iterator asserts it
            # is 0): without them it bounds the consumer's waits, as it does for state_dict().
            dataset.default_timeout = options.pop("timeout")
        # The user's collate_fn gets each step's data alone; the step goes around it.
        options["collate_fn"] = _CollateData(options.get("collate_fn") or _default_convert)
        loader = DataLoader(dataset, batch_size=None, **options)
        batches = iter(loader)
        self._loops += 1
        try:
            for step, data in batches:
                with self._lock:
                    if self._iterations != number:
                        raise _Replaced  # before the step counts as delivered
                    self._next_step = int(step) + 1
                if dataset.namespace_id is not None:  # an iteration in this process saw it
                    self.dataset._namespace_id = dataset.namespace_id
                yield step, data
        finally:
            self._loops -= 1
            # A worker still waiting for producers would hold up the shutdown for 5 s before
            # torch kills it: it gives up now instead (a flag: no reply needed from the workers,
            # some of which may be dead).
            if stop is not None:
                stop.value = 1
            # Shut the workers down now, not when ``batches`` is collected: a worker's error
            # re-raised here puts ``batches`` in a reference cycle, and collected in a cycle its
            # queues are closed before it tells the workers to stop, so torch waits 5 s for
            # each worker and then kills it, at whatever later moment the collector runs.
            shutdown = getattr(batches, "_shutdown_workers", None)
            if shutdown is not None:
                shutdown()

    def _stop_event(self) -> Any:
        """A fresh shared flag (``RawValue``, 0) of the DataLoader's multiprocessing context,
        for :attr:`WeaveDataset.stop_event`; None without workers."""
        if not self.dataloader_options.get("num_workers", 0):
            return None
        context = self.dataloader_options.get("multiprocessing_context")
        if context is None or isinstance(context, str):
            context = multiprocessing.get_context(context)
        return context.RawValue("b", 0)

    def _consumer(self) -> Consumer:
        """A never-iterated consumer that validates states and fills in the namespace id.

        Its ``timeout`` is the dataset's, else the DataLoader's ``timeout`` (if positive).
        """
        if self._shadow is None:
            store, owned = self.dataset.open_store()
            self._shadow_store = store if owned else None
            timeout = self.dataloader_options.get("timeout") or None
            self._shadow = self.dataset.consumer(store, default_timeout=timeout)
        return self._shadow

    def state_dict(self) -> dict[str, Any]:
        """The consumer state for the step after the last one this loader yielded.

        The state records the namespace id, so the first call reads the namespace's manifest
        (once it was read, later calls read nothing). Store errors on that read are handled as a
        consumer handles them: during an outage it is retried with backoff, and with a
        ``timeout`` (the dataset's consumer option, else the DataLoader's ``timeout``) it raises
        :class:`~batchweave.ConsumerTimeout` once that many seconds have passed, so the
        checkpoint can be retried or skipped. **Without a timeout it waits until the store is
        reachable again** (logging a warning when the outage starts and every 30 s), blocking
        the checkpoint meanwhile: nothing is lost, the state is only late.
        """
        shadow = self._consumer()
        # a namespace that does not exist yet delivered nothing: an empty id is accepted on load
        try:
            with contextlib.suppress(NamespaceNotFound):
                shadow.open(wait=False)
        except ConsumerTimeout as exc:
            raise ConsumerTimeout(
                f"WeaveLoader.state_dict() could not read the namespace id the state records: {exc}"
            ) from exc
        state = shadow.state_dict()
        if self._next_step is not None:
            state["step"] = self._next_step
        return state

    def resume_tgb_step(self, state: Mapping[str, Any] | None = None) -> int:
        """The first TGB step resuming from ``state`` (default: :meth:`state_dict`) reads.

        With :attr:`manifest_version` this makes the loader usable with
        :func:`batchweave.checkpoint_hook`, like a :class:`Consumer`.
        """
        return self._consumer().resume_tgb_step(self.state_dict() if state is None else state)

    @property
    def manifest_version(self) -> int | None:
        """Always ``None``: the loader's reads run in its workers, which hold the manifests.

        :func:`batchweave.checkpoint_hook` then records the namespace's latest version.
        """
        return None

    @property
    def namespace(self) -> str:
        """The namespace the dataset reads (:func:`batchweave.checkpoint_hook` checks it)."""
        return self.dataset.namespace

    @property
    def namespace_id(self) -> str | None:
        """The id of the namespace read, once known, else ``None`` (no store request).

        Known once :meth:`state_dict`, :meth:`load_state_dict` or :meth:`resume_tgb_step` opened
        the namespace, or an iteration without worker processes delivered a step (workers keep
        theirs). :func:`batchweave.checkpoint_hook` checks a ``state`` against it on every rank,
        as for a :class:`~batchweave.Consumer`.
        """
        shadow = self._shadow
        known = None if shadow is None else shadow.namespace_id
        return known or self.dataset.namespace_id

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume at ``state["step"]``: checked against the namespace, re-anchored if DP changed.

        Reads the namespace's manifest like the first :meth:`state_dict`, with the same timeout.
        Refused while a loop over this loader runs (:class:`~batchweave.ConsumerError`): its
        workers were started at another step and would go on from there.
        """
        if self._loops:
            raise ConsumerError(
                f"WeaveLoader.load_state_dict() was called while a loop over the loader is "
                f"running (next step {self._next_step}); its DataLoader workers would go on "
                "from where they are. Leave the loop (break, or close the iterator), then load "
                "the state and iterate the loader again"
            )
        shadow = self._consumer()
        shadow.load_state_dict(state)
        self._next_step = int(state["step"])  # the next iteration's dataset copy starts there

    def close(self) -> None:
        """Release the store this loader opened for checking states, if any."""
        if self._shadow is not None:
            self._shadow.close()
        if self._shadow_store is not None:
            self._shadow_store.close()
        self._shadow = self._shadow_store = None


class _Replaced(Exception):
    """A step reached an iteration a newer one replaced (:meth:`WeaveLoader._iterate`)."""


class _CollateData:
    """:class:`WeaveLoader`'s DataLoader ``collate_fn``: the user's, applied to a ``(step,
    data)`` item's data alone. The step goes around it, so a ``collate_fn`` returning anything
    (``(inputs, labels)``, say) is the loop's batch and cannot change the step it is counted as.
    Picklable for ``spawn``/``forkserver`` workers if the user's ``collate`` is.
    """

    def __init__(self, collate: Callable[[Any], Any]) -> None:
        self.collate = collate

    def __call__(self, item: tuple[int, Any]) -> tuple[int, Any]:
        step, data = item
        return step, self.collate(data)


class _LoaderIterator:
    """One iteration over a :class:`WeaveLoader`, usable until a newer one replaces it.

    Not a generator itself, so that a replaced iterator can say why it delivers nothing (a
    closed generator would just stop, and a loop over it would end as if the data had). For the
    same reason a step's error (``ConsumerTimeout``, a dead worker, Ctrl-C) leaves it usable:
    the error finished the iteration's generator (and shut its workers down), so the next
    ``next()`` starts a fresh one (a new DataLoader, new workers) at the loader's next step and
    retries that step, as a :class:`~batchweave.Consumer` does.
    """

    def __init__(self, loader: WeaveLoader, number: int) -> None:
        self._loader = loader
        self._number = number
        self._steps = loader._iterate(number)
        self._replaced_at: int | None = None
        self._ended = False
        """Whether its steps ran out: it then stops again whatever replaced it."""

    def __iter__(self) -> _LoaderIterator:
        return self

    def __next__(self) -> tuple[int, Any]:
        if self._ended:
            raise StopIteration
        if self._loader._iterations != self._number:
            self.close()
            raise self._replaced_error()
        try:
            return next(self._steps)
        except StopIteration:
            self._ended = True
            raise
        except _Replaced:  # replaced on another thread while this one waited for the step
            raise self._replaced_error() from None
        except BaseException:
            # The step's error ended the generator: the next next() retries the step in a new
            # one (created now, it runs nothing before that next()). An error that left it
            # running (another thread's next() in progress) leaves it to that thread.
            if inspect.getgeneratorstate(self._steps) == inspect.GEN_CLOSED:
                self._steps = self._loader._iterate(self._number)
            raise

    def _replaced_error(self) -> ConsumerError:
        """Why a replaced iterator delivers nothing (and where its replacement went on)."""
        at = "" if self._replaced_at is None else f" at step {self._replaced_at}"
        return ConsumerError(
            f"this iterator over the WeaveLoader was replaced by a newer iter(loader){at}, "
            "which continues from there: a loader delivers each step once, so only its "
            "newest iterator can be used. Leave one loop over the loader before starting "
            "another, or use a second WeaveLoader for a separate pass (e.g. evaluation)"
        )

    def replaced(self, at: int | None) -> None:
        """A newer iterator starts at step ``at``: stop this one's workers now."""
        self._replaced_at = at
        # Refused if it is running on another thread: it is stopped at its next step instead.
        with contextlib.suppress(ValueError):
            self.close()

    def close(self) -> None:
        """Leave the iteration: its DataLoader workers are shut down. Idempotent."""
        self._steps.close()
