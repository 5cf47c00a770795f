"""Sample ids are checked where they are written, not only where they are read back.

Before: ``sample_ids_metadata(["doc-17", "doc-42"])`` (one id string per slice) split each string
into characters, and ``Producer.append`` published sample ids with the wrong slice count; a
committed object is immutable, so ``verify`` then failed and ``export`` of any window holding
that step exited 2 forever. Now the helper refuses a string where a slice's ids belong, and the
encoder (``TgbBuilder``, so ``encode_tgb`` and ``Producer.append``) refuses a malformed value
with the validator the history reader uses, before anything is uploaded.
"""

from __future__ import annotations

import json
import os
import uuid
from pathlib import PurePosixPath

import numpy as np
import pyarrow as pa
import pytest

import batchweave as bw
import batchweave._format._tgb_write as tgb
import batchweave._history as history
from batchweave import SAMPLE_IDS_KEY, sample_ids_metadata
from batchweave._history import iter_membership


@pytest.mark.parametrize(
    ("ids", "slice_"),
    [
        (["doc-17", "doc-42"], 0),
        ([["doc-17"], "doc-42"], 1),
        ([b"doc-17", b"doc-42"], 0),
        ([["a"], 7], 1),
    ],
)
def test_a_string_where_a_slice_of_ids_belongs_is_refused(ids: list, slice_: int) -> None:
    with pytest.raises(ValueError, match=rf"slice {slice_} must be a sequence of sample ids"):
        sample_ids_metadata(ids)


@pytest.mark.parametrize("ids", ["doc-17", b"doc-17", 17])
def test_ids_that_are_not_a_sequence_of_slices_are_refused(ids: object) -> None:
    with pytest.raises(ValueError, match="one sequence of sample ids per slice"):
        sample_ids_metadata(ids)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("ids", "needle"),
    [
        ([["a"], [b"doc-1"]], r"slice 1 holds the bytes b'doc-1'.*decode bytes first"),
        ([[None]], r"slice 0 holds the NoneType None, which is no sample id"),
        ([["a", [1, 2]]], r"slice 0 holds the list \[1, 2\]"),
        ([[True]], r"slice 0 holds the bool True"),
        ([[np.bool_(False)]], r"slice 0 holds the bool"),
        ([[b"x" * 500]], r"b'xxx+\.\.\., which is no sample id"),
    ],
)
def test_an_id_that_is_no_str_int_or_float_is_refused(ids: list, needle: str) -> None:
    # Before: str() of any object was recorded (b"doc-1" as "b'doc-1'", None as "None") and
    # the export showed that text.
    with pytest.raises(ValueError, match=needle) as info:
        sample_ids_metadata(ids)
    assert "a sample id is a str, a number, or an object whose str() is the id" in str(info.value)
    assert len(str(info.value)) < 300


def test_ids_whose_str_is_the_id_are_stored_as_it() -> None:
    # A UUID or a path was refused by the first fix (it took only str, int and float).
    key = uuid.UUID("12345678-1234-5678-1234-567812345678")
    path = PurePosixPath("shard-0/doc-1.txt")
    assert sample_ids_metadata([[key, path]]) == f'[["{key}","shard-0/doc-1.txt"]]'


def test_valid_ids_are_encoded_as_strings() -> None:
    ids = [("doc-1", 2), np.array([3, 4]), [], [1.5, np.float32(0.5), np.str_("x")]]
    assert sample_ids_metadata(ids) == '[["doc-1","2"],["3","4"],[],["1.5","0.5","x"]]'


def _data_objects(store: bw.ObjectStore) -> list[str]:
    return [meta.key for meta in store.list("ids/data/")]


@pytest.mark.parametrize(
    ("value", "needle"),
    [
        (sample_ids_metadata([["doc-1", "doc-2"]]), r"one entry per slice \(2\), got 1 entry"),
        (sample_ids_metadata([["a"], ["b"], ["c"]]), r"one entry per slice \(2\), got 3 entries"),
        ('{"0": ["a"], "1": ["b"]}', r"one entry per slice \(2\), got a JSON dict"),
        ('["ab", "cd"]', "entry 0 must be a list of sample ids"),
        ('[["a"], [null]]', "entry 1 must be a list of sample ids"),
        ("[[", "is not JSON"),
        ("[" * 5_000 + "]" * 5_000, "is not JSON"),
    ],
)
def test_append_refuses_malformed_sample_ids_before_uploading(value: str, needle: str) -> None:
    store = bw.MemoryStore()
    with bw.Producer(store, "ids", producer_id="p", mesh=bw.Mesh(dp=2)) as producer:
        with pytest.raises(ValueError, match=needle) as info:
            producer.append([b"a", b"b"], offset=0, metadata={SAMPLE_IDS_KEY: value})
        assert not isinstance(info.value, bw.FormatError)
        assert "sample_ids_metadata(ids)" in str(info.value)
        assert _data_objects(store) == []
        # The producer is still usable, at the same offset.
        producer.append(
            [b"a", b"b"], offset=0, metadata={SAMPLE_IDS_KEY: sample_ids_metadata([["x"], [1]])}
        )
    assert [row.sample_ids for row in iter_membership(store, "ids")] == [("x",), ("1",)]


def test_encode_tgb_and_a_builder_refuse_them_too() -> None:
    mesh = bw.Mesh(dp=1, cp=2)
    bad = {SAMPLE_IDS_KEY: sample_ids_metadata([["a"]])}
    with pytest.raises(ValueError, match=r"one entry per slice \(2\)"):
        bw.encode_tgb([b"a", b"b"], mesh, metadata=bad)
    with pytest.raises(ValueError, match=r"one entry per slice \(2\)"):
        bw.TgbBuilder(mesh, metadata=bad)
    # The builder's metadata is a plain attribute: changed after construction, build() checks it.
    builder = bw.TgbBuilder(mesh)
    builder.set_slice(0, 0, b"a")
    builder.set_slice(0, 1, b"b")
    builder.metadata[SAMPLE_IDS_KEY] = '["a", "b"]'
    with pytest.raises(ValueError, match="entry 0 must be a list of sample ids"):
        builder.build()


def test_a_hand_assembled_tgb_with_bad_sample_ids_is_refused_at_append(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    mesh = bw.Mesh(dp=2)
    with monkeypatch.context() as patch:
        patch.setattr(tgb, "_check_sample_ids", lambda metadata, mesh: None)
        encoded = bw.encode_tgb([b"a", b"b"], mesh, metadata={SAMPLE_IDS_KEY: '[["a"]]'})
    store = bw.MemoryStore()
    with bw.Producer(store, "ids", producer_id="p", mesh=mesh) as producer:
        with pytest.raises(ValueError, match=r"one entry per slice \(2\)"):
            producer.append(encoded, offset=0)
        assert _data_objects(store) == []


def test_reader_and_writer_share_one_validator() -> None:
    assert history.SAMPLE_IDS_KEY is bw.SAMPLE_IDS_KEY
    assert history.sample_ids_metadata is bw.sample_ids_metadata
    footer = bw.encode_tgb([b"a", b"b"], bw.Mesh(dp=2)).footer
    stored = footer.model_copy(update={"metadata": {SAMPLE_IDS_KEY: '[["a"]]'}})
    with pytest.raises(bw.FormatError, match=r"object 'k': .* one entry per slice \(2\), got 1"):
        history._sample_ids(stored, "k")
    deep = footer.model_copy(update={"metadata": {SAMPLE_IDS_KEY: "[" * 5_000 + "]" * 5_000}})
    with pytest.raises(bw.FormatError, match="is not JSON"):
        history._sample_ids(deep, "k")


# -- Sample ids that are not valid Unicode (a lone surrogate) ----------------------------------

_SURROGATE_ID = b"doc-\xff".decode("utf-8", "surrogateescape")  # os.fsdecode of a non-UTF-8 name


def test_an_id_with_a_lone_surrogate_is_refused_naming_the_slice_and_the_id() -> None:
    # Before: accepted (JSON escapes it to ASCII), verify said OK, and every export of the
    # namespace then failed with a bare UnicodeEncodeError naming no step.
    with pytest.raises(ValueError, match=r"slice 1 holds the id 'doc-\\udcff'") as info:
        sample_ids_metadata([["ok"], ["fine", _SURROGATE_ID]])
    message = str(info.value)
    assert "sample ids must be valid Unicode text" in message
    assert "errors='replace'" in message
    assert "os.fsencode(name).hex()" in message
    assert sample_ids_metadata([[os.fsencode(_SURROGATE_ID).hex()]]) == '[["646f632dff"]]'
    replaced = os.fsencode(_SURROGATE_ID).decode("utf-8", errors="replace")
    assert sample_ids_metadata([[replaced]]) == '[["doc-\\ufffd"]]'
    # Valid non-ASCII text (a surrogate pair in JSON included) is an id like any other.
    assert json.loads(sample_ids_metadata([["dóc-😀"]])) == [["dóc-😀"]]


def test_append_refuses_a_caller_built_value_holding_an_escaped_lone_surrogate() -> None:
    store = bw.MemoryStore()
    raw = json.dumps([[_SURROGATE_ID], ["b"]])  # '\\udcff': valid JSON, ASCII, not UTF-8 text
    assert raw.isascii()
    with bw.Producer(store, "ids", producer_id="p", mesh=bw.Mesh(dp=2)) as producer:
        with pytest.raises(ValueError, match=r"entry 0 holds the id 'doc-\\udcff'") as info:
            producer.append([b"a", b"b"], offset=0, metadata={SAMPLE_IDS_KEY: raw})
        assert "not valid Unicode" in str(info.value)
        assert _data_objects(store) == []
        with pytest.raises(ValueError, match="not valid Unicode"):
            bw.encode_tgb([b"a", b"b"], bw.Mesh(dp=2), metadata={SAMPLE_IDS_KEY: raw})
        # A surrogate pair escaped in JSON is one valid character.
        producer.append(
            [b"a", b"b"], offset=0, metadata={SAMPLE_IDS_KEY: '[["\\ud83d\\ude00"], []]'}
        )
    assert [row.sample_ids for row in iter_membership(store, "ids")] == [("😀",), ()]


def test_the_reader_refuses_a_stored_lone_surrogate_as_a_format_error_naming_the_object() -> None:
    footer = bw.encode_tgb([b"a", b"b"], bw.Mesh(dp=2)).footer
    raw = json.dumps([["x"], [_SURROGATE_ID]])
    stored = footer.model_copy(update={"metadata": {SAMPLE_IDS_KEY: raw}})
    with pytest.raises(bw.FormatError, match=r"object 'k': .* entry 1 holds the id 'doc-\\udcff'"):
        history._sample_ids(stored, "k")


_ARROW_IDS = pa.table(
    {
        "bytes": pa.array([b"doc-1"], pa.binary()),
        "null": pa.array([None], pa.string()),
        "bool": [True],
        "list": [[1, 2]],
    }
)


@pytest.mark.parametrize(
    ("column", "needle"),
    [
        ("bytes", r"holds the bytes b'doc-1'.*decode bytes first"),
        ("null", "holds the NoneType None"),
        ("bool", "holds the bool True"),
        ("list", r"holds the list \[1, 2\]"),
    ],
)
def test_pyarrow_scalars_are_checked_by_the_value_they_hold(column: str, needle: str) -> None:
    # Before: list(table["id"]) gives pyarrow scalars, stored as "b'doc-1'", "None", "True".
    with pytest.raises(ValueError, match=needle):
        sample_ids_metadata([list(_ARROW_IDS[column])])


def test_numpy_scalars_are_checked_by_the_value_they_hold_but_keep_their_text() -> None:
    record = np.array([(1, 2)], dtype="i4,i4")[0]  # np.void: its str() is "(1, 2)"
    with pytest.raises(ValueError, match=r"holds the tuple \(1, 2\)"):
        sample_ids_metadata([[record]])
    ids = [np.float32(0.1), np.int64(3), np.str_("a"), pa.scalar("b"), pa.scalar(7, pa.int8())]
    assert sample_ids_metadata([ids]) == '[["0.1","3","a","b","7"]]'
