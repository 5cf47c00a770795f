"""The membership history (``batchweave._history``): per-slice sample ids, read back strictly.

Producers record sample ids in a TGB's metadata under ``SAMPLE_IDS_KEY`` (``sample_ids_metadata``
builds the value); ``iter_membership`` exports them as one row per slice, and refuses entries that
are not lists of ids instead of guessing (a string split into characters, a bare ``TypeError``).
The encoder now refuses such values too (``tests/test_sample_ids.py``); objects written before it
did are made here with its check switched off.
"""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pytest
from click.testing import CliRunner

import batchweave as bw
import batchweave._format._tgb_write as tgb
from batchweave import MemoryStore, Mesh, _history
from batchweave._history import SAMPLE_IDS_KEY, iter_membership
from batchweave._manifest import Committed, ManifestLog
from batchweave.cli._app import cli


@pytest.fixture
def unchecked_writer(monkeypatch: pytest.MonkeyPatch) -> None:
    """A writer that does not check sample ids (an older BatchWeave, another implementation)."""
    monkeypatch.setattr(tgb, "_check_sample_ids", lambda metadata, mesh: None)


def test_sample_ids_recorded_with_the_public_helpers_are_exported() -> None:
    store = bw.MemoryStore("ids")
    mesh = bw.Mesh(dp=2)
    with bw.Producer(store, "run", producer_id="p", mesh=mesh) as producer:
        producer.append(
            [b"a", b"b"],
            offset=0,
            metadata={bw.SAMPLE_IDS_KEY: bw.sample_ids_metadata([[1, 2], ["x"]])},
        )
    rows = list(iter_membership(store, "run"))
    assert [row.sample_ids for row in rows] == [("1", "2"), ("x",)]


@pytest.mark.parametrize("ids", ['["ab", "cd"]', "[1, 2]", '[["a"], null]', '[["a"], [{}]]'])
@pytest.mark.usefixtures("unchecked_writer")
def test_sample_ids_that_are_not_lists_of_ids_are_a_format_error(ids: str) -> None:
    """Before: a string entry was split into characters (``"ab"`` exported as ids ``a``,
    ``b``) and a number or null entry raised a bare ``TypeError``."""
    store = MemoryStore()
    with bw.Producer(store, "h", producer_id="p", mesh=Mesh(dp=2)) as p:
        p.append([b"x", b"y"], offset=0, metadata={SAMPLE_IDS_KEY: ids})
    with pytest.raises(bw.FormatError, match=r"entry \d must be a list of sample ids"):
        list(iter_membership(store, "h"))


def test_sample_ids_are_exported_per_slice() -> None:
    store = MemoryStore()
    with bw.Producer(store, "h", producer_id="p", mesh=Mesh(dp=2)) as p:
        p.append([b"x", b"y"], offset=0, metadata={SAMPLE_IDS_KEY: '[["a", 1], []]'})
    rows = list(iter_membership(store, "h"))
    assert [(r.dp, r.sample_ids) for r in rows] == [(0, ("a", "1")), (1, ())]


def test_a_start_below_base_step_is_refused_not_clipped() -> None:
    # Before: rows from base_step on, as if the history began there (the CLI refused it).
    store = MemoryStore()
    mesh = Mesh(dp=1)
    with bw.Producer(store, "run", producer_id="p", mesh=mesh) as producer:
        for offset in range(4):
            producer.append([b"x"], offset=offset)
    log = ManifestLog(store, "run")
    assert isinstance(log.commit(log.latest(), base_step=2), Committed)
    with pytest.raises(bw.StepReclaimed, match="start 1 is below base_step 2 of namespace 'run'"):
        list(iter_membership(store, "run", start=1))
    assert [row.step for row in iter_membership(store, "run", start=2)] == [2, 3]
    assert [row.step for row in iter_membership(store, "run")] == [2, 3]


@pytest.mark.parametrize(
    ("window", "error", "match"),
    [
        ({"start": True}, TypeError, "start must be an integer, got the bool"),
        ({"start": "5"}, TypeError, "start must be an integer, got the str"),
        ({"start": -1}, ValueError, "start must be >= 0, got -1"),
        ({"stop": -3}, ValueError, "stop must be >= 0, got -3"),
    ],
)
def test_a_window_of_the_wrong_type_or_sign_is_refused(
    window: dict[str, object], error: type[Exception], match: str
) -> None:
    # Before: True exported from step 1, "5" failed comparing str and int, and -1 was called a
    # reclaimed step ("steps 0..-1 were reclaimed").
    store = MemoryStore()
    with bw.Producer(store, "run", producer_id="p", mesh=Mesh(dp=1)) as producer:
        producer.append([b"x"], offset=0)
    with pytest.raises(error, match=match):
        list(iter_membership(store, "run", **window))  # type: ignore[arg-type]


def _segmented(store: bw.ObjectStore, steps: int = 12) -> ManifestLog:
    with bw.Producer(store, "ns", producer_id="p", mesh=Mesh(dp=1), tail_limit=2) as producer:
        for offset in range(steps):
            producer.append([b"x"], offset=offset)
            producer.flush()
    return ManifestLog(store, "ns")


def test_a_segment_deleted_by_hand_is_named_as_damage_with_what_to_do() -> None:
    store = MemoryStore()
    log = _segmented(store)
    latest = log.latest()
    assert latest.segments, "the namespace needs a segment for this test"
    gone = latest.segments[-1]
    store.delete_many([log.key(gone.key)])
    with pytest.raises(bw.ObjectNotFound) as caught:
        list(iter_membership(store, "ns"))
    message = str(caught.value)
    assert log.key(gone.key) in message
    assert f"{gone.first_step}..{gone.end_step - 1}" in message
    assert "batchweave verify" in message
    assert "backup" in message


def test_a_segment_reclaimed_while_reading_is_step_reclaimed() -> None:
    store = MemoryStore()
    log = _segmented(store)
    held = log.latest()
    ref = held.segments[0]
    log.commit(held, base_step=ref.end_step)  # a reclamation pass's cut, then its deletes
    store.delete_many([log.key(ref.key)])
    with pytest.raises(bw.StepReclaimed, match="Export again"):
        list(iter_membership(store, "ns", manifest=held))


def test_offsets_and_sample_counts_beyond_int64_are_refused_when_written() -> None:
    # Before: accepted, then `batchweave export` died in pyarrow ("Python int too large to
    # convert to C long"): the history's columns are int64.
    store = MemoryStore()
    mesh = Mesh(dp=1)
    with bw.Producer(store, "run", producer_id="p", mesh=mesh, policy="naive") as producer:
        with pytest.raises(bw.OffsetOrderError, match=r"offset must be at most 2\*\*63 - 1"):
            producer.append([b"x"], offset=2**63)
        producer.append([b"x"], offset=2**63 - 1)  # the largest is fine
    builder = bw.TgbBuilder(mesh)
    with pytest.raises(ValueError, match=r"slice \(0, 0\): sample_count must be at most 2\*\*63"):
        builder.set_slice(0, 0, b"x", sample_count=2**63)


def test_a_forged_value_beyond_int64_is_a_format_error_naming_the_step(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A manifest not written by BatchWeave may still hold one: export names it, no traceback.
    row = _history.MembershipRow(
        step=7,
        dp=0,
        cp=0,
        producer_id="p",
        epoch=2**70,
        offset=0,
        key="k",
        bytes=1,
        samples=1,
        sample_ids=None,
    )
    monkeypatch.setattr(_history, "iter_membership", lambda *args, **kwargs: iter([row]))
    with pytest.raises(
        bw.FormatError, match=r"step 7, slice \(0, 0\): epoch 1180591620717411303424"
    ):
        list(_history.membership_batches(MemoryStore(), "run"))


# -- Sample ids that are not valid Unicode -----------------------------------------------------


@pytest.mark.usefixtures("unchecked_writer")
def test_a_stored_lone_surrogate_id_is_found_by_verify_and_named_by_export(
    tmp_path: Path,
) -> None:
    """Before: JSON escapes a lone surrogate (``os.fsdecode`` of a non-UTF-8 file name) to
    ASCII, so ``verify`` said OK, and every export then died with a bare ``UnicodeEncodeError``
    naming no step. The encoder now refuses it (``tests/test_sample_ids.py``); an object written
    without that check is a FormatError naming the object, for verify and export alike."""
    store = bw.open_store((tmp_path / "store").as_uri())
    bad = b"doc-\xff".decode("utf-8", "surrogateescape")
    with bw.Producer(store, "h", producer_id="p", mesh=Mesh(dp=2)) as p:
        p.append([b"x", b"y"], offset=0, metadata={SAMPLE_IDS_KEY: json.dumps([["a"], [bad]])})
    needle = (
        r"object '.*\.tgb': metadata 'batchweave.sample_ids' entry 1 holds the id 'doc-\\udcff'"
    )
    with pytest.raises(bw.FormatError, match=needle):
        list(iter_membership(store, "h"))
    dest = tmp_path / "h.parquet"
    with pytest.raises(bw.FormatError, match=needle):
        _history.write_parquet(store, "h", str(dest))
    assert list(tmp_path.glob("h.parquet*")) == []
    root = str(tmp_path / "store")
    verify = CliRunner().invoke(cli, ["verify", root, "h", "--footers-only", "--json"])
    assert verify.exit_code == 1, verify.output
    [problem] = json.loads(verify.output)["problems"]
    assert problem.startswith("step 0 (p offset 0): ")
    assert "holds the id 'doc-\\udcff', which is not valid Unicode" in problem
    export = CliRunner().invoke(cli, ["export", root, "h", str(dest)])
    assert export.exit_code == 2
    assert "not valid Unicode" in export.output
    assert "UnicodeEncodeError" not in export.output


# -- Batches stay under Arrow's 2 GiB of string data -------------------------------------------


def _rows_with_ids(count: int, ids_per_row: int, chars: int) -> list[_history.MembershipRow]:
    return [
        _history.MembershipRow(
            step=i,
            dp=0,
            cp=0,
            producer_id="p",
            epoch=0,
            offset=i,
            key=f"k{i}",
            bytes=1,
            samples=ids_per_row,
            sample_ids=tuple(f"{i}-{j}-".ljust(chars, "x") for j in range(ids_per_row)),
        )
        for i in range(count)
    ]


def test_batches_end_when_their_sample_ids_reach_the_byte_budget(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Before: batches were cut at 8,192 rows only, and ``sample_ids`` (``list<string>``, 32-bit
    offsets) holding over 2 GiB of text in one batch died with a raw pyarrow ``TypeError``
    ("Cannot convert pyarrow.lib.ChunkedArray to pyarrow.lib.Array"). Now a batch also ends once
    its ids reach ``BATCH_SAMPLE_ID_BYTES`` (256 MiB); here a budget of 1,000 bytes stands in
    for it, 2 GiB of ids being too much for a test."""
    assert 0 < _history.BATCH_SAMPLE_ID_BYTES <= (2**31 - 1) // 4
    rows = _rows_with_ids(10, ids_per_row=4, chars=96)  # 4 * (96 + 4) = 400 bytes a row
    monkeypatch.setattr(_history, "iter_membership", lambda *args, **kwargs: iter(rows))
    monkeypatch.setattr(_history, "BATCH_SAMPLE_ID_BYTES", 1_000)
    batches = list(_history.membership_batches(MemoryStore(), "run"))
    assert [b.num_rows for b in batches] == [3, 3, 3, 1]
    assert all(b.schema == _history.MEMBERSHIP_SCHEMA for b in batches)
    table = pa.Table.from_batches(batches)
    assert table.column("sample_ids").to_pylist() == [list(r.sample_ids or ()) for r in rows]
    # Rows without ids count nothing: only batch_rows ends their batches.
    plain = [_history.MembershipRow(**{**vars(r), "sample_ids": None}) for r in rows]
    monkeypatch.setattr(_history, "iter_membership", lambda *args, **kwargs: iter(plain))
    sizes = [b.num_rows for b in _history.membership_batches(MemoryStore(), "run", batch_rows=4)]
    assert sizes == [4, 4, 2]
    # Non-ASCII ids count their UTF-8 bytes; a row over the budget is a batch of its own.
    wide = _rows_with_ids(3, ids_per_row=1, chars=1)
    wide = [_history.MembershipRow(**{**vars(r), "sample_ids": ("é" * 600,)}) for r in wide]
    monkeypatch.setattr(_history, "iter_membership", lambda *args, **kwargs: iter(wide))
    assert [b.num_rows for b in _history.membership_batches(MemoryStore(), "run")] == [1, 1, 1]


def test_many_empty_ids_end_a_batch_too(monkeypatch: pytest.MonkeyPatch) -> None:
    """The ids' offsets are 32-bit as well: empty ids, no text at all, still count 4 bytes."""
    rows = _rows_with_ids(5, ids_per_row=100, chars=0)
    rows = [_history.MembershipRow(**{**vars(r), "sample_ids": ("",) * 100}) for r in rows]
    monkeypatch.setattr(_history, "iter_membership", lambda *args, **kwargs: iter(rows))
    monkeypatch.setattr(_history, "BATCH_SAMPLE_ID_BYTES", 800)
    assert [b.num_rows for b in _history.membership_batches(MemoryStore(), "run")] == [2, 2, 1]
