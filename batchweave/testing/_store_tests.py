"""``StoreTests``: the conformance suite every :class:`ObjectStore` backend must pass.

Subclass it in a pytest module and provide a ``store`` fixture that yields a fresh, empty store
(or a fresh prefix of a shared one) for each test::

    from batchweave.testing import StoreTests

    class TestMyStore(StoreTests):
        race_rounds = 10  # class attributes scale the heavy tests for networked backends

        @pytest.fixture
        def store(self):
            with MyStore(...) as s:
                yield s

Every behaviour the rest of BatchWeave relies on is pinned here: atomic create-if-absent under
contention, byte-range semantics, lexicographic listing with ``start_after`` and pagination,
idempotent bulk deletion, large and empty objects, odd key characters, key validation, the
argument checks every built-in store makes before any request (``delete_many`` refuses a single
key and deletes nothing if any key is invalid, ``get_range`` anything but a ``ByteRange``,
``put`` a ``mode`` that is not a ``PutMode``), buffers of any layout and the error types.
"""

from __future__ import annotations

import array
import itertools
import random
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, ClassVar

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from batchweave._errors import (
    ConcurrentWriteConflict,
    InvalidKey,
    ObjectExists,
    ObjectNotFound,
)
from batchweave._store._base import Bounded, ByteRange, ObjectStore, Offset, PutMode, Suffix

__all__ = ["StoreTests", "expected_range"]

_MiB = 1 << 20
_LARGE_READ = 8 * _MiB
"""Bytes of the large object read with ``get_range_into`` and ``map_range``: several socket
reads and stream chunks, far beyond any single read's size."""

ODD_KEYS: tuple[str, ...] = (
    "with space/file name.bin",
    "unicode/ünïcödé-日本語-🙂",
    "plus+sign",
    "equals=sign",
    "percent%20literal%",
    "tilde~name",
    "at@sign",
    "bang!",
    "quote'name",
    "paren(1)",
    "star*",
    "comma,semi;colon:",
    "dollar$amp&",
    "hash#frag",
    "dots.in...name",
    "-leading-dash",
    "_underscore",
)

INVALID_KEYS: tuple[str, ...] = (
    "",
    "/absolute",
    "..",
    "a/../b",
    "../escape",
    ".",
    "a/./b",
    "a//b",
    "trailing/",
    "nul\x00byte",
    "back\\slash",
)


def expected_range(data: bytes, rng: ByteRange) -> bytes:
    """The bytes ``rng`` selects from ``data``, by plain slicing (the reference semantics)."""
    if isinstance(rng, Bounded):
        return data[rng.start : rng.end]
    if isinstance(rng, Offset):
        return data[rng.start :]
    return data[-rng.length :]


def _range_strategy(size: int) -> st.SearchStrategy[ByteRange]:
    pos = st.integers(min_value=0, max_value=size + 16)
    bounded = st.tuples(pos, pos).map(lambda t: Bounded(min(t), max(t)))
    return st.one_of(
        bounded,
        st.builds(Offset, pos),
        st.builds(Suffix, st.integers(min_value=1, max_value=size + 16)),
    )


def _run_parallel(threads: int, fn: Callable[[Any], Any], items: Sequence[Any]) -> list[Any]:
    with ThreadPoolExecutor(threads) as pool:
        return list(pool.map(fn, items))


class StoreTests:
    """Conformance tests for an :class:`ObjectStore`. Subclasses provide the ``store`` fixture.

    Class attributes size the heavy tests; networked backends may lower them.
    """

    race_rounds: ClassVar[int] = 50
    """Rounds of the create-if-absent race."""
    race_threads: ClassVar[int] = 32
    """Threads racing on one key per round."""
    many_keys: ClassVar[int] = 1100
    """Objects in the pagination and bulk-delete test (must exceed 1,000, one LIST page)."""
    upload_threads: ClassVar[int] = 16
    """Threads used to upload test fixtures quickly."""
    large_object_size: ClassVar[int] = 64 * _MiB
    """Size of the large-object round trip."""
    range_examples: ClassVar[int] = 200
    """Hypothesis examples for random byte ranges."""
    visibility_rounds: ClassVar[int] = 30
    """Overwrites observed by concurrent readers in the atomic-visibility test."""

    @pytest.fixture
    def store(self) -> ObjectStore:
        """A fresh, empty store (or prefix) per test. Subclasses must override this."""
        raise NotImplementedError(f"{type(self).__name__} must define a `store` fixture")

    # -- basic reads and writes --------------------------------------------------------------

    def test_put_get_head(self, store: ObjectStore) -> None:
        store.put("dir/obj", b"hello world")
        assert store.get("dir/obj") == b"hello world"
        meta = store.head("dir/obj")
        assert meta.key == "dir/obj"
        assert meta.size == 11
        assert abs(meta.last_modified - time.time()) < 300

    def test_put_accepts_memoryview(self, store: ObjectStore) -> None:
        payload = b"0123456789abcdef"
        store.put("mv", memoryview(payload)[4:12])
        assert store.get("mv") == b"456789ab"

    def test_put_accepts_a_non_contiguous_or_typed_buffer(self, store: ObjectStore) -> None:
        # Its bytes are stored, as bytes(view) gives them: every ``[::2]`` item, and a typed
        # array's bytes in its own layout.
        store.put("strided", memoryview(b"abcdef")[::2])
        assert store.get("strided") == b"ace"
        store.put_parts("strided-parts", [b"<", memoryview(b"abcdef")[1::2], b">"])
        assert store.get("strided-parts") == b"<bdf>"
        words = array.array("I", [1, 2, 3])
        store.put("typed", memoryview(words))
        assert store.get("typed") == words.tobytes()

    def test_put_refuses_a_mode_that_is_not_a_put_mode(self, store: ObjectStore) -> None:
        # ``check_mode``: "create", True or None is no PutMode; taken for "not CREATE" it
        # would silently replace an object the caller meant to create only if absent.
        store.put("k", b"original")
        modes: list[Any] = ["create", "overwrite", PutMode.CREATE.value, True, False, None, 1]
        for mode in modes:
            with pytest.raises(TypeError, match=r"mode must be a PutMode"):
                store.put("k", b"CLOBBERED", mode=mode)
            with pytest.raises(TypeError, match=r"mode must be a PutMode"):
                store.put_parts("k", [b"CLOB", b"BERED"], mode=mode)
            with pytest.raises(TypeError, match=r"mode must be a PutMode"):
                store.put("new", b"x", mode=mode)
        assert store.get("k") == b"original"
        assert [m.key for m in store.list()] == ["k"]

    def test_put_parts_writes_their_concatenation(self, store: ObjectStore) -> None:
        base = bytes(range(256)) * 40
        parts: list[bytes | memoryview] = [
            base[:7],
            memoryview(base)[7:9000],
            b"",
            memoryview(bytearray(base[9000:])),
            b"end",
        ]
        store.put_parts("parts/obj", parts)
        assert store.get("parts/obj") == base + b"end"
        assert store.head("parts/obj").size == len(base) + 3
        store.put_parts("parts/empty", [])
        assert store.get("parts/empty") == b""

    def test_put_parts_create_is_conditional(self, store: ObjectStore) -> None:
        store.put_parts("parts/taken", [b"orig", b"inal"], mode=PutMode.CREATE)
        with pytest.raises(ObjectExists):
            store.put_parts("parts/taken", [b"intr", b"uder"], mode=PutMode.CREATE)
        assert store.get("parts/taken") == b"original"

    def test_overwrite_replaces(self, store: ObjectStore) -> None:
        store.put("k", b"first version, longer")
        store.put("k", b"second", mode=PutMode.OVERWRITE)
        assert store.get("k") == b"second"
        assert store.head("k").size == 6

    def test_missing_object_raises_object_not_found(self, store: ObjectStore) -> None:
        for call in (
            lambda: store.get("missing/key"),
            lambda: store.head("missing/key"),
            lambda: store.get_range("missing/key", Bounded(0, 10)),
            lambda: store.get_range("missing/key", Bounded(0, 0)),
            lambda: store.get_range("missing/key", Suffix(3)),
        ):
            with pytest.raises(ObjectNotFound) as info:
                call()
            assert isinstance(info.value, FileNotFoundError)
            assert "missing/key" in str(info.value)

    # -- create-if-absent --------------------------------------------------------------------

    def test_put_if_absent_creates(self, store: ObjectStore) -> None:
        store.put_if_absent("new", b"payload")
        assert store.get("new") == b"payload"

    def test_put_if_absent_existing_raises_and_keeps_original(self, store: ObjectStore) -> None:
        store.put("taken", b"original")
        with pytest.raises(ObjectExists) as info:
            store.put_if_absent("taken", b"intruder")
        assert isinstance(info.value, FileExistsError)
        with pytest.raises(ObjectExists):
            store.put("taken", b"intruder", mode=PutMode.CREATE)
        assert store.get("taken") == b"original"

    def test_put_if_absent_after_delete_succeeds(self, store: ObjectStore) -> None:
        store.put_if_absent("k", b"one")
        store.delete_many(["k"])
        store.put_if_absent("k", b"two")
        assert store.get("k") == b"two"

    def test_put_if_absent_race_has_exactly_one_winner(self, store: ObjectStore) -> None:
        n = self.race_threads
        with ThreadPoolExecutor(n) as pool:
            for round_ in range(self.race_rounds):
                key = f"race/{round_:04d}"
                barrier = threading.Barrier(n)
                attempts = [(store, key, barrier, f"{key} writer {i}".encode()) for i in range(n)]
                winners = [p for p in pool.map(_race_attempt, attempts) if p is not None]
                assert len(winners) == 1, f"round {round_}: {len(winners)} winners on {key!r}"
                assert store.get(key) == winners[0], f"round {round_}: content is not the winner's"

    # -- byte ranges -------------------------------------------------------------------------

    @pytest.mark.parametrize("size", [0, 1, 1000])
    def test_range_edge_cases(self, store: ObjectStore, size: int) -> None:
        data = random.Random(size).randbytes(size)
        store.put("obj", data)
        cases: list[ByteRange] = [
            Bounded(0, 0),
            Bounded(0, 1),
            Bounded(0, size),
            Bounded(0, size + 10),
            Bounded(size // 2, size // 2),
            Bounded(size // 3, 2 * size // 3 + 1),
            Bounded(size, size + 5),
            Bounded(size + 5, size + 10),
            Offset(0),
            Offset(size // 2),
            Offset(size),
            Offset(size + 7),
            Suffix(1),
            Suffix(max(1, size)),
            Suffix(size + 100),
        ]
        for rng in cases:
            assert store.get_range("obj", rng) == expected_range(data, rng), rng

    @pytest.mark.parametrize("size", [0, 1, 1000])
    def test_get_range_into_fills_the_buffer(self, store: ObjectStore, size: int) -> None:
        data = random.Random(size).randbytes(size)
        store.put("obj", data)
        for start, length in [(0, 0), (0, size), (size // 3, size // 3 + 1), (size // 2, size)]:
            buf = bytearray(b"\xee" * length)
            n = store.get_range_into("obj", start, memoryview(buf))
            got = data[start : start + length]
            assert n == len(got), (start, length)
            assert bytes(buf[:n]) == got, (start, length)
            assert buf[n:] == b"\xee" * (length - n), "bytes past the object's end were written"
        with pytest.raises(ObjectNotFound):
            store.get_range_into("missing/key", 0, memoryview(bytearray(4)))

    def test_get_range_into_fills_a_typed_buffer_by_bytes(self, store: ObjectStore) -> None:
        # A view whose items are not bytes (uint32: 4 items, 16 bytes) takes ``nbytes`` bytes.
        data = bytes(range(32))
        store.put("obj", data)
        words = array.array("I", [0] * 4)
        assert store.get_range_into("obj", 0, memoryview(words)) == 16
        assert words.tobytes() == data[:16]
        words = array.array("I", [0] * 4)
        assert store.get_range_into("obj", 24, memoryview(words)) == 8  # the object's end
        assert words.tobytes() == data[24:] + bytes(8)

    def test_map_range_is_declined_or_exact(self, store: ObjectStore) -> None:
        data = random.Random(7).randbytes(3000)
        store.put("obj", data)
        for start, end in [(0, 3000), (100, 2000), (2999, 3000), (1000, 5000), (3000, 3010)]:
            view = store.map_range("obj", start, end)
            if view is None:
                return  # this store cannot map: readers fall back to get_range
            assert view.readonly
            assert bytes(view) == data[start:end], (start, end)
            view.release()
        with pytest.raises(ObjectNotFound):
            store.map_range("missing/key", 0, 10)

    def test_random_ranges_match_reference(self, store: ObjectStore) -> None:
        data = random.Random(1).randbytes(4099)
        store.put("ref", data)

        @settings(
            max_examples=self.range_examples,
            deadline=None,
            database=None,
            derandomize=True,
            suppress_health_check=[HealthCheck.too_slow],
        )
        @given(rng=_range_strategy(len(data)))
        def check(rng: ByteRange) -> None:
            assert store.get_range("ref", rng) == expected_range(data, rng)

        check()

    def test_get_range_refuses_a_tuple_naming_the_range_types(self, store: ObjectStore) -> None:
        # A tuple such as (0, 3) is no ByteRange: refused before any request (``check_range``),
        # for a missing key too, not failed deep inside ('tuple' has no attribute 'length').
        store.put("k", b"0123456789")
        for key in ("k", "missing"):
            with pytest.raises(TypeError, match=r"must be a Bounded, Offset or Suffix"):
                store.get_range(key, (0, 3))  # type: ignore[arg-type]
        assert store.get_range("k", Bounded(0, 3)) == b"012"

    # -- listing -----------------------------------------------------------------------------

    def test_list_order_prefix_and_start_after(self, store: ObjectStore) -> None:
        payloads = {
            "a/1": b"1",
            "a/2": b"22",
            "a/sub/3": b"333",
            "a0": b"4444",
            "ab": b"5",
            "b/1": b"6",
        }
        for key, data in payloads.items():
            store.put(key, data)

        def keys(prefix: str = "", start_after: str | None = None) -> list[str]:
            return [m.key for m in store.list(prefix, start_after=start_after)]

        assert keys() == sorted(payloads)
        assert {m.key: m.size for m in store.list()} == {k: len(v) for k, v in payloads.items()}
        assert keys("a/") == ["a/1", "a/2", "a/sub/3"]
        assert keys("a") == ["a/1", "a/2", "a/sub/3", "a0", "ab"]
        assert keys("a/su") == ["a/sub/3"]
        assert keys("zzz") == []
        assert keys(start_after="a/2") == ["a/sub/3", "a0", "ab", "b/1"]
        assert keys(start_after="a/s") == ["a/sub/3", "a0", "ab", "b/1"]
        assert keys(start_after="a/sub/3") == ["a0", "ab", "b/1"]
        assert keys("a/", start_after="a/1") == ["a/2", "a/sub/3"]
        assert keys("a/", start_after="0") == ["a/1", "a/2", "a/sub/3"]
        assert keys("a/", start_after="z") == []
        assert keys(start_after="b/1") == []

    def test_list_order_is_bytewise_across_directories(self, store: ObjectStore) -> None:
        # '-' (0x2d) sorts before '/' (0x2f): "a-b" comes before every key under "a/".
        for key in ("a/1", "a-b", "a.c", "a0"):
            store.put(key, b"x")
        assert [m.key for m in store.list()] == ["a-b", "a.c", "a/1", "a0"]
        assert [m.key for m in store.list(start_after="a-b")] == ["a.c", "a/1", "a0"]
        assert [m.key for m in store.list(start_after="a/1")] == ["a0"]

    def test_list_empty_store(self, store: ObjectStore) -> None:
        assert list(store.list()) == []
        assert list(store.list("nothing/", start_after="nothing/a")) == []

    def test_list_paginates_and_delete_many_over_1000_keys(self, store: ObjectStore) -> None:
        keys = [f"many/{i:05d}" for i in range(self.many_keys)]
        _run_parallel(self.upload_threads, lambda k: store.put(k, k.encode()), keys)
        store.put("other/keep", b"x")

        listed = list(store.list("many/"))
        assert [m.key for m in listed] == keys
        assert all(m.size == len(m.key) for m in listed)
        middle = self.many_keys // 2
        assert [m.key for m in store.list("many/", start_after=keys[middle])] == keys[middle + 1 :]
        assert [m.key for m in itertools.islice(store.list("many/"), 3)] == keys[:3]

        # One invalid key after more than a bulk delete's 1,000 keys deletes nothing: every key
        # is checked before the first request, not batch by batch.
        with pytest.raises(InvalidKey):
            store.delete_many(iter([*keys, "many/bad//key"]))
        assert [m.key for m in store.list("many/")] == keys

        missing = [f"many/missing-{i}" for i in range(5)]
        store.delete_many(iter(keys + missing))
        assert list(store.list("many/")) == []
        assert [m.key for m in store.list()] == ["other/keep"]
        store.delete_many(keys)  # idempotent

    # -- deletion ----------------------------------------------------------------------------

    def test_delete_many_ignores_missing_keys(self, store: ObjectStore) -> None:
        store.put("d/1", b"1")
        store.put("d/2", b"2")
        store.delete_many([])
        store.delete_many(["d/1", "d/never", "nowhere/at/all"])
        with pytest.raises(ObjectNotFound):
            store.get("d/1")
        assert store.get("d/2") == b"2"
        assert [m.key for m in store.list()] == ["d/2"]

    def test_delete_many_refuses_a_single_key_instead_of_iterating_it(
        self, store: ObjectStore
    ) -> None:
        # A single key is refused (``check_keys``), not iterated: delete_many("ab") would delete
        # the keys "a" and "b" and keep "ab".
        for key in ("a", "b", "ab"):
            store.put(key, b"x")
        for single in ("ab", b"ab", bytearray(b"ab"), None, 3):
            with pytest.raises(
                TypeError, match=r"pass a list of keys, e\.g\. delete_many\(\[key\]\)"
            ):
                store.delete_many(single)  # type: ignore[arg-type]
        assert [m.key for m in store.list()] == ["a", "ab", "b"]
        store.delete_many(key for key in ["ab"])  # any iterable of keys, a generator too
        store.delete_many(("a",))
        assert [m.key for m in store.list()] == ["b"]

    def test_delete_many_with_an_invalid_key_deletes_nothing(self, store: ObjectStore) -> None:
        # Every key is checked (``checked_keys``) before any is deleted, for a list and for a
        # generator (read once): the keys before the invalid one stay too.
        for key in ("keep-1", "keep-2", "keep-3"):
            store.put(key, b"x")
        batches: list[Any] = [
            ["keep-1", "bad//key", "keep-2"],
            (key for key in ["keep-1", "keep-2", "../escape"]),
            ["keep-3", "keep-1", 7],
        ]
        for batch in batches:
            with pytest.raises(InvalidKey):
                store.delete_many(batch)
            assert [m.key for m in store.list()] == ["keep-1", "keep-2", "keep-3"]
        store.delete_many(key for key in ["keep-1", "keep-3"])
        assert [m.key for m in store.list()] == ["keep-2"]

    # -- sizes -------------------------------------------------------------------------------

    def test_zero_byte_object(self, store: ObjectStore) -> None:
        store.put("empty", b"")
        assert store.get("empty") == b""
        assert store.head("empty").size == 0
        assert store.get_range("empty", Suffix(10)) == b""
        assert store.get_range("empty", Offset(0)) == b""
        assert [(m.key, m.size) for m in store.list()] == [("empty", 0)]
        store.put_if_absent("empty-created", b"")
        with pytest.raises(ObjectExists):
            store.put_if_absent("empty-created", b"")

    def test_large_object_round_trip(self, store: ObjectStore) -> None:
        # Every read returns all it was asked for, however large: readers (``Consumer``) rely
        # on it, and a store that returns one chunk of a streamed body (1 MiB), fills a buffer
        # from one socket read (64 KiB) or maps a capped window would pass every small read.
        size = self.large_object_size
        data = random.Random(64).randbytes(size)
        store.put("large", data)
        assert store.head("large").size == size
        assert store.get("large") == data
        assert store.get_range("large", Suffix(_MiB)) == data[-_MiB:]
        mid = size // 2
        assert (
            store.get_range("large", Bounded(mid - 10, mid + 4096)) == data[mid - 10 : mid + 4096]
        )
        most = Bounded(1, size - 1)  # nearly all of it, not from 0: no whole-object shortcut
        assert _same_bytes(store.get_range("large", most), data[1 : size - 1]), most
        span = min(size - 2, _LARGE_READ)
        buf = bytearray(span)
        n = store.get_range_into("large", 1, memoryview(buf))
        assert n == span, f"get_range_into read {n} of {span} bytes"
        assert _same_bytes(buf, data[1 : 1 + span])
        view = store.map_range("large", 1, 1 + span)
        if view is not None:  # None: this store cannot map (the ``map_range`` contract)
            assert len(view) == span, f"map_range mapped {len(view)} of {span} bytes"
            assert _same_bytes(view, data[1 : 1 + span])
            view.release()

    # -- keys --------------------------------------------------------------------------------

    def test_odd_but_legal_key_characters(self, store: ObjectStore) -> None:
        for key in ODD_KEYS:
            store.put(key, key.encode())
        for key in ODD_KEYS:
            assert store.get(key) == key.encode(), key
            assert store.head(key).size == len(key.encode()), key
        assert [m.key for m in store.list()] == sorted(ODD_KEYS)
        store.delete_many(ODD_KEYS)
        assert list(store.list()) == []

    @pytest.mark.parametrize("key", INVALID_KEYS, ids=repr)
    def test_invalid_keys_rejected(self, store: ObjectStore, key: str) -> None:
        for call in (
            lambda: store.put(key, b"x"),
            lambda: store.put_if_absent(key, b"x"),
            lambda: store.get(key),
            lambda: store.head(key),
            lambda: store.get_range(key, Suffix(1)),
            lambda: store.delete_many([key]),
        ):
            with pytest.raises(InvalidKey) as info:
                call()
            assert isinstance(info.value, ValueError)
        assert list(store.list()) == []

    # -- atomic visibility -------------------------------------------------------------------

    def test_readers_never_see_partial_objects(self, store: ObjectStore) -> None:
        size = 256 * 1024
        store.put("atomic", bytes(size))
        done = threading.Event()
        seen: list[int] = []
        errors: list[BaseException] = []

        def read_until_done() -> None:
            try:
                while not done.is_set():
                    data = store.get("atomic")
                    if len(data) != size or data.count(data[0]) != size:
                        raise AssertionError(f"partial object: {len(data)} bytes, mixed content")
                    seen.append(data[0])
            except BaseException as exc:
                errors.append(exc)

        readers = [threading.Thread(target=read_until_done) for _ in range(2)]
        for t in readers:
            t.start()
        try:
            for i in range(1, self.visibility_rounds + 1):
                store.put("atomic", bytes([i % 256]) * size)
        finally:
            done.set()
            for t in readers:
                t.join()
        assert not errors, errors[0]
        assert seen, "readers never completed a read"
        assert store.get("atomic") == bytes([self.visibility_rounds % 256]) * size


def _same_bytes(got: bytes | bytearray | memoryview, expected: bytes) -> bool:
    """``got == expected``, reported by size and first difference (not megabytes of repr)."""
    if got == expected:
        return True
    first = next(
        (i for i, (a, b) in enumerate(zip(memoryview(got), expected, strict=False)) if a != b),
        min(len(got), len(expected)),
    )
    raise AssertionError(
        f"{len(got)} bytes read, {len(expected)} expected; they first differ at byte {first}"
    )


def _race_attempt(args: tuple[ObjectStore, str, threading.Barrier, bytes]) -> bytes | None:
    store, key, barrier, payload = args
    barrier.wait()
    try:
        store.put_if_absent(key, payload)
    except (ObjectExists, ConcurrentWriteConflict):
        return None
    return payload
