"""The store layer against hostile or mistaken inputs: each is refused with an error that names
the problem, never a leaked resource, a bare ``OSError`` or a silently different store.

- ``FileStore`` reads of a key that is a directory (``a`` when ``a/b`` exists) raise
  ``ObjectNotFound`` and close every descriptor they opened;
- a ``file://`` root the file system cannot check (too long, a symlink loop, a lone surrogate)
  is ``InvalidStoreURL`` naming the root, shortened if very long;
- ``FaultInjectingStore.fail_next`` refuses an op it would never fire, and the example in
  ``docs/store.md`` fires;
- a control character in a store URL (which ``urlsplit`` drops or strips) is refused;
- ``ensure_conditional_writes`` works for any store, hashable or not, once per instance, and
  keeps no store alive;
- byte ranges take integers only.
"""

from __future__ import annotations

import dataclasses
import gc
import os
import re
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import batchweave as bw
from batchweave import (
    Bounded,
    FileStore,
    InvalidStoreURL,
    MemoryStore,
    ObjectNotFound,
    ObjectStore,
    Offset,
    Suffix,
)
from batchweave._store._open import check_store_url, store_url_scheme

DOCS = Path(__file__).resolve().parent.parent / "docs"
PROC_FD = "/proc/self/fd"


def _open_fds() -> int:
    return len(os.listdir(PROC_FD))


# -- FileStore: a directory where an object is asked for -------------------------------------


def _directory_reads(store: FileStore) -> dict[str, Callable[[], object]]:
    """Every read of the key ``d``, which is a directory (``d/x`` is an object)."""
    return {
        "get": lambda: store.get("d"),
        "get_range": lambda: store.get_range("d", Bounded(0, 10)),
        "get_range_into": lambda: store.get_range_into("d", 0, memoryview(bytearray(10))),
        "map_range": lambda: store.map_range("d", 0, 10),
        "head": lambda: store.head("d"),
    }


@pytest.fixture
def dir_store(tmp_path: Path) -> FileStore:
    store = FileStore(tmp_path / "root", fsync=False)
    store.put("d/x", b"1")  # "d" is now a directory
    return store


@pytest.mark.skipif(not os.path.isdir(PROC_FD), reason="counts descriptors in /proc/self/fd")
@pytest.mark.parametrize("via_proc_fd", [True, False], ids=["confined-fd", "realpath"])
@pytest.mark.parametrize("read", ["get", "get_range", "get_range_into", "map_range", "head"])
def test_read_of_a_directory_key_is_not_found_and_leaks_no_descriptor(
    dir_store: FileStore, read: str, via_proc_fd: bool
) -> None:
    dir_store._proc_fd = via_proc_fd  # both ways of opening a key for reading
    call = _directory_reads(dir_store)[read]
    before = _open_fds()
    for _ in range(20):
        with pytest.raises(ObjectNotFound, match=r"no object 'd' in file://.*directory"):
            call()
    assert _open_fds() == before, f"{read} on a directory key leaked descriptors"


@pytest.mark.skipif(not os.path.isdir(PROC_FD), reason="counts descriptors in /proc/self/fd")
@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs a FIFO")
def test_read_of_a_planted_fifo_leaks_no_descriptor(tmp_path: Path) -> None:
    store = FileStore(tmp_path, fsync=False)
    os.mkfifo(tmp_path / "pipe")
    before = _open_fds()
    for call in (lambda: store.get("pipe"), lambda: store.get_range("pipe", Offset(0))):
        with pytest.raises(ObjectNotFound, match="a FIFO"):
            call()
    assert _open_fds() == before


def test_directory_key_then_object_reads_normally(dir_store: FileStore) -> None:
    # The fix reads through the same descriptor it checked: objects still read whole.
    dir_store.put("big", os.urandom(3 << 20))
    assert dir_store.get("big") == dir_store.get_range("big", Offset(0))
    assert dir_store.get("d/x") == b"1"


# -- FileStore: roots the file system cannot check -------------------------------------------


def _too_long_name(tmp_path: Path) -> Path:
    return tmp_path / ("x" * 300)  # one name past NAME_MAX (255 bytes)


def _too_long_path(tmp_path: Path) -> Path:
    return tmp_path.joinpath(*["a"] * 2100)  # short names, past PATH_MAX (4096 bytes)


@pytest.mark.parametrize("make_root", [_too_long_name, _too_long_path], ids=["name", "path"])
@pytest.mark.parametrize("opener", ["FileStore", "open_store"])
def test_root_too_long_is_invalid_store_url_naming_it_shortened(
    tmp_path: Path, make_root: Callable[[Path], Path], opener: str
) -> None:
    root = make_root(tmp_path)
    open_root = FileStore if opener == "FileStore" else lambda root: bw.open_store(root.as_uri())
    with pytest.raises(InvalidStoreURL) as info:
        open_root(root)
    message = str(info.value)
    assert "too long" in message
    assert "choose a shorter root" in message
    assert str(tmp_path) in message  # names the root by its start ...
    assert f"({len(str(root))} characters)" in message  # ... and says it was shortened
    assert len(message) < 800, "a root thousands of characters long is not quoted whole"
    assert not os.path.exists(tmp_path / "a"), "nothing of an unusable root is created"


def test_root_in_a_symlink_loop_is_invalid_store_url(tmp_path: Path) -> None:
    loop = tmp_path / "loop"
    loop.symlink_to(loop)
    with pytest.raises(InvalidStoreURL, match=r"'.*/loop/x' cannot be used \(Too many levels"):
        FileStore(loop / "x")


def test_root_with_a_lone_surrogate_is_invalid_store_url(tmp_path: Path) -> None:
    with pytest.raises(InvalidStoreURL, match=r"contains '\\ud800', which no file name can hold"):
        FileStore(f"{tmp_path}/bad\ud800")
    # An undecodable byte as os.fsdecode gives it (surrogateescape) is a fine directory name.
    root = FileStore(os.fsdecode(os.fsencode(tmp_path) + b"/caf\xe9"), fsync=False)
    root.put("k", b"v")
    assert root.get("k") == b"v"


# -- FaultInjectingStore.fail_next -----------------------------------------------------------


@pytest.mark.parametrize(
    ("op", "hint"),
    [
        ("delete", "use 'delete_many'"),
        ("put_if_absent", "use 'put'"),
        ("put_parts", "use 'put'"),
        ("get_range_into", "use 'get_range'"),
        ("puts", ""),
        ("PUT", ""),
        (None, ""),
    ],
)
def test_fail_next_refuses_an_op_it_would_never_fire(op: Any, hint: str) -> None:
    store = bw.FaultInjectingStore(MemoryStore())
    with pytest.raises(ValueError, match="unknown op") as info:
        store.fail_next(op)
    message = str(info.value)
    assert hint in message
    assert "'put', 'get', 'get_range', 'head', 'list', 'delete_many'" in message
    store.put_if_absent("k", b"v")  # nothing was scripted
    assert store.injected == {}


@pytest.mark.parametrize("op", ["put", "get", "get_range", "head", "list", "delete_many"])
def test_fail_next_fires_for_every_op_it_accepts(op: str) -> None:
    store = bw.FaultInjectingStore(MemoryStore())
    store.put("k", b"v")
    store.fail_next(op)  # type: ignore[arg-type]
    calls: dict[str, Callable[[], object]] = {
        "put": lambda: store.put_if_absent("k2", b"v"),  # put_if_absent goes through put
        "get": lambda: store.get("k"),
        "get_range": lambda: store.get_range_into("k", 0, memoryview(bytearray(1))),
        "head": lambda: store.head("k"),
        "list": lambda: list(store.list()),
        "delete_many": lambda: store.delete_many(["k"]),
    }
    with pytest.raises(bw.StoreError, match="injected"):
        calls[op]()
    assert store.injected == {f"scripted_{op}": 1}


def test_docs_fail_next_example_fires_on_a_producer() -> None:
    text = (DOCS / "store.md").read_text()
    found = re.search(r"`(fail_next\(\"put\", landed=True, key_prefix=\"([^\"]+)\"\))`", text)
    assert found, "docs/store.md no longer shows a fail_next example with a key_prefix"
    call, prefix = found.groups()
    # Every key BatchWeave writes begins with its namespace: "{namespace}/_manifests/...".
    namespace, _, rest = prefix.rpartition("/_manifests/")
    assert namespace, f"{prefix!r} is no manifest key prefix: keys begin with the namespace"
    assert "/" not in namespace
    assert not rest
    store = bw.FaultInjectingStore(MemoryStore())
    producer = bw.Producer(store, namespace, producer_id="a", mesh=bw.Mesh(dp=1), policy="naive")
    # Armed once the producer started: creating the namespace and the epoch commit are no
    # commit attempts, so only the commit of the append below counts as ambiguous.
    eval(f"store.{call}", {"store": store})  # the example exactly as the docs write it
    try:
        producer.append([b"x"], offset=0)
    finally:
        producer.close()
    assert store.injected == {"scripted_put": 1}, f"the example {call} never fired"
    assert producer.stats().ambiguous == 1


# -- control characters in store URLs --------------------------------------------------------

_CONTROL = ["\t", "\n", "\r", "\x00", "\x01", "\x1f", "\x7f"]
_URLS = [
    "s3://bucket/run{c}1",
    "s3://bucket/run1{c}",
    "{c}s3://bucket/run1",
    "s3://buck{c}et/run1",
    "file:///tmp/run{c}1",
    "memory://run{c}1",
]


@pytest.mark.parametrize("url", _URLS)
@pytest.mark.parametrize("char", _CONTROL, ids=lambda c: f"U+{ord(c):04X}")
def test_control_character_in_url_is_refused_naming_it(url: str, char: str) -> None:
    url = url.format(c=char)
    position = url.index(char)
    for parse in (
        lambda: bw.open_store(url, verify_conditional_writes=False, endpoint_url="http://x:1"),
        lambda: check_store_url(url),
        lambda: store_url_scheme(url),
    ):
        with pytest.raises(InvalidStoreURL) as info:
            parse()
        message = str(info.value)
        assert f"control character {char!r} (U+{ord(char):04X}) at position {position}" in message


def test_control_character_message_does_not_echo_credentials() -> None:
    url = "s3://AKIAEXAMPLEKEY:wJalrXUtn\tFEMI/K7MDENG@bucket/prefix"
    with pytest.raises(InvalidStoreURL) as info:
        check_store_url(url)
    message = str(info.value)
    assert "AKIAEXAMPLEKEY" not in message
    assert "wJalr" not in message
    assert "K7MDENG" not in message
    assert "'s3://***@bucket/prefix' contains the control character '\\t'" in message


def test_percent_escaped_control_character_still_names_a_directory(tmp_path: Path) -> None:
    root = tmp_path / "run\t1"
    store = bw.open_store(root.as_uri(), verify_conditional_writes=False)  # as_uri: %09
    assert Path(store.root) == root  # type: ignore[attr-defined]


# -- ensure_conditional_writes: any store, once per instance ---------------------------------


class _Counted(bw.StoreWrapper):
    """Counts creates, to see whether the probe ran."""

    creates = 0

    def put(
        self, key: str, data: bytes | memoryview, *, mode: bw.PutMode = bw.PutMode.OVERWRITE
    ) -> None:
        if mode is bw.PutMode.CREATE:
            _Counted.creates += 1
        super().put(key, data, mode=mode)


@dataclasses.dataclass(eq=True)
class _UnhashableStore(_Counted):
    inner: ObjectStore

    def __post_init__(self) -> None:
        self.url = self.inner.url


@dataclasses.dataclass(frozen=True)
class _EqualStore(_Counted):
    """Hashable, and two of them on one inner store compare equal."""

    inner: ObjectStore

    @property
    def url(self) -> str:  # type: ignore[override]
        return self.inner.url


@pytest.fixture
def reset_creates() -> Iterator[None]:
    _Counted.creates = 0
    yield
    _Counted.creates = 0


@pytest.mark.usefixtures("reset_creates")
def test_ensure_conditional_writes_on_an_unhashable_store_probes_once() -> None:
    store = _UnhashableStore(MemoryStore())
    with pytest.raises(TypeError):
        hash(store)
    bw.ensure_conditional_writes(store)
    bw.ensure_conditional_writes(store)
    assert _Counted.creates == 2  # one probe: two creates of one key


@pytest.mark.usefixtures("reset_creates")
def test_ensure_conditional_writes_is_per_instance_not_per_equal_store() -> None:
    inner = MemoryStore()
    first, second = _EqualStore(inner), _EqualStore(inner)
    assert first == second
    assert first is not second
    bw.ensure_conditional_writes(first)
    bw.ensure_conditional_writes(second)
    assert _Counted.creates == 4


@pytest.mark.usefixtures("reset_creates")
def test_ensure_conditional_writes_keeps_no_store_alive() -> None:
    store = _UnhashableStore(MemoryStore())
    bw.ensure_conditional_writes(store)
    ref = weakref.ref(store)
    del store
    gc.collect()
    assert ref() is None, "the verified-stores cache keeps a store alive"
    # A new store (which may get the dead one's id) is probed: never taken for the old one.
    for _ in range(20):
        bw.ensure_conditional_writes(_UnhashableStore(MemoryStore()))
    assert _Counted.creates == 2 * 21


# -- byte ranges: integers only --------------------------------------------------------------


@pytest.mark.parametrize(
    ("make", "field"),
    [
        (lambda: Bounded(1.0, 3), "Bounded.start"),  # type: ignore[arg-type]
        (lambda: Bounded(1, 3.0), "Bounded.end"),  # type: ignore[arg-type]
        (lambda: Bounded(True, 3), "Bounded.start"),
        (lambda: Bounded(0, None), "Bounded.end"),  # type: ignore[arg-type]
        (lambda: Bounded("0", 3), "Bounded.start"),  # type: ignore[arg-type]
        (lambda: Offset(2.0), "Offset.start"),  # type: ignore[arg-type]
        (lambda: Offset(np.float64(2)), "Offset.start"),  # type: ignore[arg-type]
        (lambda: Suffix(False), "Suffix.length"),
        (lambda: Suffix(2.5), "Suffix.length"),  # type: ignore[arg-type]
    ],
)
def test_range_with_a_non_integer_is_a_type_error_naming_the_field(
    make: Callable[[], object], field: str
) -> None:
    with pytest.raises(TypeError, match=rf"^{re.escape(field)} must be an int, got "):
        make()


def test_range_of_numpy_integers_is_plain_ints_on_every_backend(store: ObjectStore) -> None:
    rng = Bounded(np.int64(1), np.uint32(3))  # type: ignore[arg-type]
    assert type(rng.start) is int
    assert type(rng.end) is int
    assert rng == Bounded(1, 3)
    assert hash(rng) == hash(Bounded(1, 3))
    assert type(Offset(np.int8(1)).start) is int  # type: ignore[arg-type]
    assert type(Suffix(np.int16(2)).length) is int  # type: ignore[arg-type]
    store.put("k", b"abcdef")
    assert store.get_range("k", rng) == b"bc"
    with pytest.raises(ValueError, match="invalid byte range"):
        Bounded(np.int64(3), 1)  # type: ignore[arg-type]
