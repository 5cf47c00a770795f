"""Bad constructor arguments are refused up front, in one line naming the argument.

An over-long ``producer_id`` or ``namespace`` where a producer would create it (before: the
producer's epoch was committed, then every upload failed with ``File name too long`` or
``KeyTooLongError``; a namespace or id that exists stays usable by every client), a
``session_token`` without its key pair (before: a raw botocore ``TypeError`` in a
``StoreError``), and a ``Mesh`` degree that is not a positive int (before: a multi-line
pydantic ``ValidationError``, or ``True``, ``"4"`` and ``1.0`` silently accepted).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from click.testing import CliRunner
from manifest_helpers import KEY, body, envelope

import batchweave as bw
import batchweave._checks as checks
from batchweave._format._tgb_write import _pack_trailer
from batchweave._manifest import Manifest
from batchweave._manifest._codec import decode_manifest, encode_manifest
from batchweave._manifest._log import ManifestLog
from batchweave._store._open import check_store_url
from batchweave.cli._app import cli
from batchweave.testing import free_port

MESH = bw.Mesh(dp=2)
NAMESPACE = "runs/s16"
TOKEN = "IQoJb3JpZ2luX2VjEXAMPLETOKEN-s16"

# The longest names allowed: a 200-byte producer id (3-byte characters count as 3) and a
# 512-byte namespace whose longest part is 255 bytes.
LONGEST_PRODUCER_ID = "€" * 66 + "xx"
LONGEST_NAMESPACE = "a" * 255 + "/" + "b" * 254 + "/c"

# Over the limits, yet fine for a file:// store (parts under 255 bytes): names a namespace and a
# producer could have been created with before the limits.
OLD_NAMESPACE = "/".join(c * 200 for c in "abc")  # 602 bytes
OLD_PRODUCER_ID = "p" * 230


def _producer(store: bw.ObjectStore, namespace: str, producer_id: str) -> bw.Producer:
    return bw.Producer(store, namespace, producer_id=producer_id, mesh=MESH, policy="naive")


# -- long producer ids and namespaces ----------------------------------------------------------


@pytest.mark.parametrize(
    ("producer_id", "size"),
    [("x" * 201, 201), ("x" * 1100, 1100), (LONGEST_PRODUCER_ID + "y", 201), ("é" * 101, 202)],
    ids=["ascii-201", "ascii-1100", "euro-201", "e-acute-202"],
)
def test_an_over_long_producer_id_is_refused_before_its_epoch_is_committed(
    producer_id: str, size: int
) -> None:
    # Before: accepted, its epoch committed to the manifest, then every append failed with a
    # 1.5-3.5 KB ProducerError wrapping "[Errno 36] File name too long" / KeyTooLongError.
    store = bw.MemoryStore()
    with pytest.raises(bw.InvalidKey) as info:
        _producer(store, NAMESPACE, producer_id)
    message = str(info.value)
    assert message.startswith("producer_id ")
    assert f"is {size} bytes long; at most 200 bytes" in message
    assert "\n" not in message
    assert len(message) < 300  # the id is cut, not repeated in full
    assert list(store.list("")) == []  # nothing written: no namespace, no epoch
    # Joining an existing namespace as a new id is its first commit too: refused, nothing added.
    _producer(store, NAMESPACE, "p0").close()
    keys = sorted(meta.key for meta in store.list(""))
    with pytest.raises(bw.InvalidKey, match=f"is {size} bytes long; at most 200 bytes"):
        _producer(store, NAMESPACE, producer_id)
    assert sorted(meta.key for meta in store.list("")) == keys


@pytest.mark.parametrize(
    ("make", "needle"),
    [
        (lambda s: _producer(s, LONGEST_NAMESPACE + "d", "p0"), "is 513 bytes long"),
        (lambda s: _producer(s, "n" * 600, "p0"), "is 600 bytes long"),
        (lambda s: _producer(s, "runs/" + "q" * 256, "p0"), "has a 256-byte part 'qqqq"),
        (lambda s: _producer(s, "é" * 128 + "/x", "p0"), "has a 256-byte part 'éééé"),
    ],
    ids=["producer-513", "producer-600", "part-256", "e-acute-part-256"],
)
def test_an_over_long_namespace_or_namespace_part_is_refused_before_it_is_created(
    make: Callable[[bw.ObjectStore], object], needle: str
) -> None:
    # A namespace is the prefix of every key: over 512 bytes, a producer's data keys no longer
    # fit S3's 1024-byte limit; a part over 255 bytes is no file name in a file:// store.
    store = bw.MemoryStore()
    with pytest.raises(bw.InvalidKey, match=r"^namespace ") as info:
        make(store)
    assert needle in str(info.value)
    assert "\n" not in str(info.value)
    assert list(store.list("")) == []  # no version 0


@pytest.fixture
def old_store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> bw.ObjectStore:
    """A file store holding OLD_NAMESPACE, offsets 0-1 committed by OLD_PRODUCER_ID."""
    store = bw.open_store(tmp_path.as_uri())
    with monkeypatch.context() as patch:  # as a version before the limits wrote it
        patch.setattr(checks, "_MAX_NAME_BYTES", {})
        patch.setattr(checks, "MAX_NAME_SEGMENT_BYTES", 1 << 20)
        with _producer(store, OLD_NAMESPACE, OLD_PRODUCER_ID) as producer:
            for offset in range(2):
                producer.append([b"a" * 8, b"b" * 8], offset=offset)
    return store


def test_a_namespace_created_before_the_limits_can_still_be_read(old_store: bw.ObjectStore) -> None:
    # The limits are for names being created: a consumer, reclaimer, watermarks, the manifest
    # log and the CLI open an existing over-long namespace (before: InvalidKey, so its data
    # could not be read at all after an upgrade).
    consumer = bw.Consumer(old_store, OLD_NAMESPACE, mesh=MESH, dp_rank=0, timeout=10)
    try:
        assert [next(consumer)[0], next(consumer)[0]] == [0, 1]
    finally:
        consumer.close()
    assert bw.Reclaimer(old_store, OLD_NAMESPACE).run_once().latest_version >= 1
    assert bw.Watermarks(old_store, OLD_NAMESPACE).boundary() == 0
    assert ManifestLog(old_store, OLD_NAMESPACE).create_or_open().producers[OLD_PRODUCER_ID]
    result = CliRunner().invoke(cli, ["inspect", old_store.url, OLD_NAMESPACE, "--json"])
    assert result.exit_code == 0, result.output
    assert OLD_PRODUCER_ID in result.output


def test_an_existing_over_long_producer_id_restarts_and_others_join(
    old_store: bw.ObjectStore,
) -> None:
    # Restarting an id the producer table lists is no creation: it resumes where it stopped
    # (before: InvalidKey, so the producer could not restart under its own id).
    with _producer(old_store, OLD_NAMESPACE, OLD_PRODUCER_ID) as producer:
        assert (producer.epoch, producer.resume_offset) == (2, 2)
        producer.append([b"c" * 8, b"d" * 8], offset=2)
    # A new id within the limits joins the over-long namespace.
    with _producer(old_store, OLD_NAMESPACE, "p1") as producer:
        producer.append([b"e" * 8, b"f" * 8], offset=0)
    consumer = bw.Consumer(old_store, OLD_NAMESPACE, mesh=MESH, dp_rank=1, timeout=10)
    try:
        assert [next(consumer)[0] for _ in range(4)] == [0, 1, 2, 3]
    finally:
        consumer.close()
    # A new id over the limits is still refused there, before its first commit.
    versions = ManifestLog(old_store, OLD_NAMESPACE).create_or_open().version
    with pytest.raises(bw.InvalidKey, match=r"^producer_id 'qqq.* is 230 bytes long"):
        _producer(old_store, OLD_NAMESPACE, "q" * 230)
    assert ManifestLog(old_store, OLD_NAMESPACE).create_or_open().version == versions


def test_the_longest_names_allowed_work_on_a_file_store(tmp_path: Path) -> None:
    # The limits refuse nothing that works: the longest names publish and read back through a
    # file:// store (255-byte directory names), and one byte more is refused.
    store = bw.open_store(tmp_path.as_uri())
    with _producer(store, LONGEST_NAMESPACE, LONGEST_PRODUCER_ID) as producer:
        for offset in range(3):
            producer.append([b"a" * 8, b"b" * 8], offset=offset)
        producer.seal()
    consumer = bw.Consumer(store, LONGEST_NAMESPACE, mesh=MESH, dp_rank=1, timeout=10)
    try:
        assert [step for step, _ in consumer] == [0, 1, 2]
    finally:
        consumer.close()
    with pytest.raises(bw.InvalidKey, match=r"^producer_id "):
        _producer(store, LONGEST_NAMESPACE, LONGEST_PRODUCER_ID + "z")


# -- a session token without its key pair ------------------------------------------------------


@pytest.mark.parametrize("s3_client", ["boto3", "obstore"])
@pytest.mark.parametrize("verify", [True, False])
def test_a_session_token_without_keys_is_an_invalid_store_url(s3_client: str, verify: bool) -> None:
    # Before: boto3 raised StoreError "put_if_absent ... failed: TypeError: sequence item 0:
    # expected str instance, NoneType found" (at the first request with the probe off), and
    # obstore AccessDenied "no usable AWS credentials (none were given ...)".
    options: dict[str, Any] = {
        "s3_client": s3_client,
        "endpoint_url": f"http://127.0.0.1:{free_port()}",  # nothing is sent
        "session_token": TOKEN,
    }
    with pytest.raises(bw.InvalidStoreURL, match="session_token was given without") as info:
        bw.open_store("s3://bkt/p", verify_conditional_writes=verify, **options)
    assert "access_key_id and secret_access_key" in str(info.value)
    assert TOKEN not in str(info.value)
    with pytest.raises(bw.InvalidStoreURL, match="session_token was given without"):
        check_store_url("s3://bkt/p", **options)
    # With its key pair the token is fine (no request is made without the probe).
    store = bw.open_store(
        "s3://bkt/p",
        verify_conditional_writes=False,
        access_key_id="AKIDS16",
        secret_access_key="s16-secret",
        **options,
    )
    store.close()


# -- mesh degrees ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("degrees", "message"),
    [
        ({"dp": 0}, "Mesh dp must be >= 1, got 0"),
        ({"dp": -2}, "Mesh dp must be >= 1, got -2"),
        ({"dp": 4, "cp": 0}, "Mesh cp must be >= 1, got 0"),
        ({"dp": 1 << 21}, "Mesh dp must be <= 1048576, got 2097152"),
    ],
)
def test_a_mesh_degree_below_one_is_a_one_line_value_error(
    degrees: dict[str, int], message: str
) -> None:
    # Before: a multi-line pydantic ValidationError with a pydantic.dev URL.
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        bw.Mesh(**degrees)


@pytest.mark.parametrize(
    ("degrees", "shown"),
    [
        ({"dp": True}, "the bool True"),
        ({"dp": "4"}, "the str '4'"),
        ({"dp": 1.0}, "the float 1.0"),
        ({"dp": 2, "cp": 2.0}, "the float 2.0"),
        ({"dp": None}, "the NoneType None"),
    ],
)
def test_a_mesh_degree_that_is_no_int_is_a_type_error(degrees: dict[str, Any], shown: str) -> None:
    # Before: True, "4" and 1.0 were silently converted (dp_rank=True was a TypeError already).
    with pytest.raises(TypeError, match="must be an integer, got " + shown) as info:
        bw.Mesh(**degrees)
    assert "\n" not in str(info.value)


def test_numpy_degrees_are_accepted_and_stored_meshes_still_decode_as_before() -> None:
    mesh = bw.Mesh(dp=np.int64(4), cp=np.int32(2))
    assert (type(mesh.dp), type(mesh.cp), mesh.slices) == (int, int, 8)
    assert bw.Mesh.model_validate_json(mesh.model_dump_json()) == mesh
    # Decoding a stored mesh does not go through Mesh.__init__: a bad stored degree stays a
    # FormatError naming the field (a TypeError from the constructor would escape the decoder).
    manifest = Manifest(namespace_id="ns", mesh=MESH, version=7, parent=6, commit_id="c")
    for bad in (0, -1, "4", 1.5, 1 << 21):
        doc = json.loads(body(encode_manifest(manifest)))
        doc["mesh"]["dp"] = bad
        with pytest.raises(bw.FormatError, match=r"invalid manifest: mesh\.dp"):
            decode_manifest(envelope(json.dumps(doc).encode()), key=KEY)
    tgb = bw.encode_tgb([b"abc", b"defg"], MESH)
    doc = json.loads(tgb.footer.model_dump_json())
    for bad in (0, "2", True):
        doc["mesh"]["dp"] = bad
        raw = json.dumps(doc).encode()
        crafted = tgb.data[: tgb.footer_offset] + raw + _pack_trailer(raw, 1, "crc32c")
        with pytest.raises(bw.FormatError, match="invalid TGB footer"):
            bw.parse_footer(crafted, key="data/p0/1/x.tgb")
    # The constructor is stricter than the decoder: True is no degree (before: Mesh(dp=1)).
    with pytest.raises(TypeError, match="dp must be an integer, got the bool True"):
        bw.Mesh(dp=True)


# -- a URL (or anything else) where an opened store is needed ------------------------------------


_STORE_TAKERS: dict[str, Callable[[Any], object]] = {
    "ensure_conditional_writes": bw.ensure_conditional_writes,
    "read_footer": lambda store: bw.read_footer(store, "k"),
    "read_slice": lambda store: bw.read_slice(
        store, "k", bw.encode_tgb([b"abc", b"defg"], MESH).footer, 0
    ),
    "StoreWrapper": bw.StoreWrapper,
    "CountingStore": bw.CountingStore,
    "FaultInjectingStore": lambda store: bw.FaultInjectingStore(store, seed=1),
}
"""The store-layer and format-layer entry points taking an opened store."""


@pytest.mark.parametrize("name", list(_STORE_TAKERS))
def test_store_and_format_calls_refuse_a_url_or_non_store(name: str, tmp_path: Path) -> None:
    # Before: AttributeError: 'str' object has no attribute 'url' (or 'get_range', ...).
    call = _STORE_TAKERS[name]
    with pytest.raises(TypeError, match=r"open it first \(store = batchweave.open_store\(url\)\)"):
        call(tmp_path.as_uri())
    with pytest.raises(TypeError, match="expected an opened store, got the PosixPath"):
        call(tmp_path)
    for other in (None, 3, object()):
        with pytest.raises(TypeError, match=r"expected an opened store \(a batchweave.ObjectStore"):
            call(other)
    assert not any(tmp_path.iterdir())  # nothing was opened or written


def test_check_store_is_one_implementation_the_store_layer_shares() -> None:
    from batchweave._store._base import check_store

    assert checks.check_store is check_store
    check_store(bw.MemoryStore())  # an opened store passes
    check_store(bw.CountingStore(bw.MemoryStore()))


@pytest.mark.parametrize("rng", [(0, 3), [0, 3], slice(0, 3), range(3), 3, None, "0-3"], ids=repr)
def test_get_range_refuses_what_is_not_a_byte_range_naming_the_types(rng: object) -> None:
    # Before: AttributeError: 'tuple' object has no attribute 'length' (the Suffix branch).
    store = bw.MemoryStore()
    store.put("k", b"0123456789")
    for target in (store, bw.CountingStore(store), bw.FaultInjectingStore(store, seed=1)):
        for key in ("k", "missing"):  # refused before the object is looked up
            with pytest.raises(TypeError, match=r"must be a Bounded, Offset or Suffix, got the"):
                target.get_range(key, rng)  # type: ignore[arg-type]
    counting = bw.CountingStore(store)
    with pytest.raises(TypeError):
        counting.get_range("k", rng)  # type: ignore[arg-type]
    assert counting.snapshot().requests == 0  # a refused argument is no request


def test_resolve_range_refuses_a_non_range_for_custom_stores() -> None:
    from batchweave._store._base import resolve_range

    assert resolve_range(bw.Suffix(3), 10) == (7, 10)
    with pytest.raises(TypeError, match=r"must be a Bounded, Offset or Suffix"):
        resolve_range((0, 3), 10)  # type: ignore[arg-type]
