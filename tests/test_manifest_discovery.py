"""Finding the newest manifest version costs O(log versions) LIST requests, not one per page.

Histories of tens of thousands of versions are written straight into a MemoryStore (copies of one
genesis manifest, encoded once per version), since discovery only lists their keys and reads a
few of them; requests are counted as an S3 backend would issue them (1,000 keys per LIST page).
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from batchweave import CountingStore, MemoryStore, Mesh, ObjectMeta, StoreWrapper
from batchweave._manifest import Manifest, ManifestLog, manifest_key
from batchweave._manifest._codec import decode_manifest, encode_manifest

NS = "runs/long"
OLD = 1000.0
"""``created_at`` of every version: far older than the clients' clocks, so that a missing
successor is never trusted as "current" and the LIST decides."""
NOW = 10.0**6

_GENESIS: list[Manifest] = []
_ENCODED: list[bytes] = []


def _version(v: int) -> bytes:
    """Manifest version ``v`` of the one namespace these tests share, encoded (cached)."""
    if not _GENESIS:
        store = MemoryStore()
        genesis = ManifestLog(store, NS, clock=lambda: OLD).create_or_open(Mesh(dp=1, cp=1))
        _GENESIS.append(genesis)
    while len(_ENCODED) <= v:
        n = len(_ENCODED)
        update = {"version": n, "parent": n - 1 if n else None, "commit_id": f"{n:032x}"}
        _ENCODED.append(encode_manifest(_GENESIS[0].model_copy(update=update)))
    return _ENCODED[v]


def _history(newest: int, floor: int = 0) -> MemoryStore:
    """A namespace holding versions ``floor..newest`` (the ones below were reclaimed)."""
    _version(newest)
    store = MemoryStore()
    for v in range(floor, newest + 1):
        store.put(f"{NS}/{manifest_key(v)}", _ENCODED[v])
    return store


def _manifest(v: int) -> Manifest:
    return decode_manifest(_version(v), key=manifest_key(v))


def _log(store: MemoryStore | StoreWrapper) -> ManifestLog:
    return ManifestLog(store, NS, clock=lambda: NOW)


def _bound(versions: int) -> int:
    """LIST requests allowed to find the newest of ``versions``: logarithmic in their pages."""
    return 2 * math.ceil(math.log2(max(1.0, versions / 1000))) + 3


@pytest.mark.parametrize("newest", [999, 5_000, 20_000, 50_000])
@pytest.mark.parametrize("how", ["fresh latest()", "latest(known)", "latest_from(known)"])
def test_finding_the_newest_version_costs_logarithmically_many_list_requests(
    newest: int, how: str
) -> None:
    counting = CountingStore(_history(newest))
    log = _log(counting)
    known = _manifest(0)
    counting.reset()
    if how == "fresh latest()":
        found = log.latest()
    elif how == "latest(known)":
        found = log.latest(known)
    else:
        found = log.latest_from(known)
    used = counting.snapshot()
    assert found.version == newest
    assert used.list_pages <= _bound(newest + 1), (how, newest, used)
    assert used.gets + used.range_gets <= 2


def test_the_newest_is_found_above_reclaimed_versions() -> None:
    # The reclaimer deleted everything below version 41_000; a client that knew version 7
    # (reclaimed, like its successor) and a fresh one both find the newest.
    newest, floor = 45_000, 41_000
    counting = CountingStore(_history(newest, floor))
    for found in (_log(counting).latest(), _log(counting).latest(_manifest(7))):
        assert found.version == newest
    counting.reset()
    assert _log(counting).latest_from(_manifest(7)).version == newest
    assert counting.snapshot().list_pages <= _bound(newest - floor + 1)


class _ReclaimingWhileListing(StoreWrapper):
    """Deletes the ``per_list`` oldest versions at every LIST call: a reclaimer racing the
    search (it never deletes the newest version)."""

    def __init__(self, inner: MemoryStore, per_list: int) -> None:
        super().__init__(inner)
        self.per_list = per_list

    def list(self, prefix: str = "", *, start_after: str | None = None) -> Iterator[ObjectMeta]:
        keys = [m.key for m in self.inner.list(f"{NS}/_manifests/")]
        self.inner.delete_many(keys[: min(self.per_list, len(keys) - 1)])
        return self.inner.list(prefix, start_after=start_after)


def test_versions_reclaimed_during_the_search_do_not_hide_the_newest() -> None:
    store = _ReclaimingWhileListing(_history(30_000), per_list=2_500)
    assert _log(store).latest().version == 30_000
    store = _ReclaimingWhileListing(_history(30_000), per_list=2_500)
    assert _log(store).latest_from(_manifest(3)).version == 30_000


class _LaggingListing(StoreWrapper):
    """A listing that shows no version above ``shown`` to LISTs starting after ``cutoff``
    (SeaweedFS's listing lagging behind writes, for some requests only)."""

    def __init__(self, inner: MemoryStore, cutoff: int, shown: int) -> None:
        super().__init__(inner)
        self.cutoff, self.shown = f"{NS}/{manifest_key(cutoff)}", f"{NS}/{manifest_key(shown)}"

    def list(self, prefix: str = "", *, start_after: str | None = None) -> Iterator[ObjectMeta]:
        for meta in self.inner.list(prefix, start_after=start_after):
            if start_after is not None and start_after > self.cutoff and meta.key > self.shown:
                return
            yield meta


def test_a_probe_listing_nothing_too_early_never_lowers_the_answer() -> None:
    # LISTs starting after version 1_999 show nothing above 2_999: the probes ahead list
    # nothing, yet the search returns at least the newest version a page did list (2_999, from
    # the page after 1_999), not the first page's 999.
    store = _LaggingListing(_history(5_000), cutoff=1_999, shown=2_999)
    assert 2_999 <= _log(store).latest().version <= 5_000


@settings(max_examples=60)
@given(
    st.integers(0, 12_000).flatmap(
        lambda newest: st.tuples(
            st.just(newest),
            st.integers(0, newest),
            st.none() | st.integers(0, newest),
        )
    )
)
def test_the_search_finds_the_true_newest_version(case: tuple[int, int, int | None]) -> None:
    newest, floor, known = case
    counting = CountingStore(_history(newest, floor))
    if known is None:
        assert _log(counting).latest().version == newest
    else:
        assert _log(counting).latest(_manifest(known)).version == newest
        assert _log(counting).latest_from(_manifest(known)).version == newest
    assert counting.snapshot().list_pages <= 3 * _bound(newest - floor + 1)
