"""Security: hostile files under a ``file://`` root, credentials in store and endpoint URLs,
hostile JSON nesting, and where the metrics endpoint listens.

Complements ``test_hostile.py``, ``test_fuzz.py``, ``test_store_file.py`` and
``test_environment_errors.py``.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import traceback
from pathlib import Path

import pytest
from manifest_helpers import body, envelope

from batchweave import (
    FormatError,
    InvalidKey,
    InvalidStoreURL,
    MemoryStore,
    Mesh,
    ObjectNotFound,
    ObstoreS3Store,
    Producer,
    S3Store,
    StoreError,
    StoreUnavailable,
    encode_tgb,
    open_store,
)
from batchweave._format._codecs import get_codec
from batchweave._history import SAMPLE_IDS_KEY, _sample_ids
from batchweave._manifest._codec import (
    decode_manifest,
    decode_segment,
)
from batchweave._metrics import start_metrics_server
from batchweave._store._base import Bounded
from batchweave._store._file import TEMP_DIR_NAME, FileStore
from batchweave.testing import free_port

SECRET = "SeCrEt-0f7e3a-not-a-real-key"
PASSWORD = "Pa55w0rd-9c1d"


@pytest.fixture
def store(tmp_path: Path) -> FileStore:
    return FileStore(tmp_path / "root", fsync=False)


def _reads(store: FileStore, key: str) -> list[object]:
    """Call every read path on ``key`` and return what each raised (or returned)."""
    outcomes: list[object] = []
    calls = (
        lambda: store.get(key),
        lambda: store.get_range(key, Bounded(0, 10)),
        lambda: store.get_range_into(key, 0, memoryview(bytearray(10))),
        lambda: store.map_range(key, 0, 10),
        lambda: store.head(key),
    )
    for call in calls:
        try:
            outcomes.append(call())
        except StoreError as exc:
            outcomes.append(exc)
    return outcomes


# -- file:// confinement --------------------------------------------------------------------


def test_a_planted_fifo_is_not_an_empty_object(store: FileStore) -> None:
    # Before the audit, get() and map_range() returned b"" for a FIFO: a planted FIFO read as
    # an (empty) object instead of a missing one.
    os.mkfifo(os.path.join(store.root, "fifo"))
    for outcome in _reads(store, "fifo"):
        assert isinstance(outcome, ObjectNotFound), outcome
        assert "'fifo'" in str(outcome)
        assert "a FIFO" in str(outcome)


def test_a_planted_socket_or_directory_is_not_an_object(store: FileStore) -> None:
    os.makedirs(os.path.join(store.root, "dir", "child"))
    with socket.socket(socket.AF_UNIX) as sock:
        sock.bind(os.path.join(store.root, "sock"))
        for key in ("dir", "sock"):
            for outcome in _reads(store, key):
                assert isinstance(outcome, ObjectNotFound), (key, outcome)
                assert repr(key) in str(outcome)


def test_a_symlink_into_the_temp_directory_is_refused(store: FileStore) -> None:
    # A key reaching ``.bw-tmp`` through a symlink could read in-flight temp files or plant
    # objects among them.
    os.symlink(os.path.join(store.root, TEMP_DIR_NAME), os.path.join(store.root, "alias"))
    with pytest.raises(InvalidKey, match=r"'alias/x'.*reserved directory"):
        store.put("alias/x", b"v")
    assert os.listdir(os.path.join(store.root, TEMP_DIR_NAME)) == []
    Path(store.root, TEMP_DIR_NAME, "inflight.tmp").write_bytes(b"half-written")
    for outcome in _reads(store, "alias/inflight.tmp"):
        assert isinstance(outcome, InvalidKey), outcome


def test_over_long_keys_fail_with_the_key_named(store: FileStore) -> None:
    for key in ("a" * 300, "/".join(["b" * 250] * 20)):
        with pytest.raises(StoreError, match=key[:20]):
            store.put(key, b"v")
        for outcome in _reads(store, key):
            assert isinstance(outcome, StoreError)
            assert key[:20] in str(outcome)


def test_a_put_over_a_hard_link_never_writes_to_the_outside_file(
    tmp_path: Path, store: FileStore
) -> None:
    outside = tmp_path / "outside"
    outside.write_bytes(b"precious")
    os.link(outside, os.path.join(store.root, "hl"))
    store.put("hl", b"new")
    assert store.get("hl") == b"new"
    assert outside.read_bytes() == b"precious"


# -- credentials ----------------------------------------------------------------------------


@pytest.mark.parametrize("cls", [S3Store, ObstoreS3Store])
@pytest.mark.parametrize(
    "endpoint",
    [
        f"http://user:{PASSWORD}@127.0.0.1:9",
        f"ftp://user:{PASSWORD}@127.0.0.1:9",
        f"http://user:p@{PASSWORD}@127.0.0.1:9",  # an '@' inside the password
        # '://' mistyped or missing: the error said "is not an http(s) URL", secret and all
        f"http:/user:{PASSWORD}@127.0.0.1:9",
        f"http//user:{PASSWORD}@127.0.0.1:9",
        f"user:{PASSWORD}@127.0.0.1:9",
        f"user:{PASSWORD}/x@127.0.0.1:9",  # a '/' inside the password
        # A third slash, or a later '://' (masking started there): shown in clear before.
        f"http:///user:{PASSWORD}@127.0.0.1:9",
        f"http:/user:{PASSWORD}@127.0.0.1:9/a://b",
    ],
)
def test_an_endpoint_with_url_credentials_is_refused_without_echoing_them(
    cls: type[S3Store] | type[ObstoreS3Store], endpoint: str
) -> None:
    # Before the audit the password was accepted and then shown in repr() and every error.
    with pytest.raises(InvalidStoreURL) as info:
        cls("bucket", endpoint_url=endpoint, access_key_id="AK", secret_access_key=SECRET)
    text = "".join(traceback.format_exception(info.value))
    assert PASSWORD not in text
    assert SECRET not in text
    assert "***@127.0.0.1" in str(info.value)


def test_an_environment_endpoint_with_url_credentials_is_refused(
    aws_env: pytest.MonkeyPatch,
) -> None:
    # botocore takes the endpoint from the environment, credentials and all; before the audit
    # they then appeared in every connection error.
    aws_env.setenv("AWS_ENDPOINT_URL_S3", f"http://user:{PASSWORD}@127.0.0.1:{free_port()}")
    with pytest.raises(InvalidStoreURL, match=r"\*\*\*@127\.0\.0\.1") as info:
        S3Store("bucket", region="us-east-1", access_key_id="AK", secret_access_key=SECRET)
    assert PASSWORD not in "".join(traceback.format_exception(info.value))


@pytest.mark.parametrize("cls", [S3Store, ObstoreS3Store])
@pytest.mark.parametrize(
    "endpoint",
    [
        f"http:/user:{PASSWORD}@127.0.0.1:9",
        f"http//user:{PASSWORD}@127.0.0.1:9",
        f"user:{PASSWORD}@127.0.0.1:9",
    ],
)
def test_an_environment_endpoint_with_mistyped_slashes_does_not_echo_its_credentials(
    aws_env: pytest.MonkeyPatch, cls: type[S3Store] | type[ObstoreS3Store], endpoint: str
) -> None:
    # Before: obstore's check and botocore's "Invalid endpoint: ..." (quoted, and kept in the
    # chained cause) showed the password, masked only after '://'.
    aws_env.setenv("AWS_ENDPOINT_URL", endpoint)
    with pytest.raises(InvalidStoreURL, match=r"\*\*\*@127\.0\.0\.1") as info:
        cls("bucket", region="us-east-1", access_key_id="AK", secret_access_key=SECRET)
    assert PASSWORD not in "".join(traceback.format_exception(info.value))


def test_the_cli_does_not_echo_credentials_of_a_mistyped_endpoint(
    aws_env: pytest.MonkeyPatch,
) -> None:
    endpoint = f"http:/user:{PASSWORD}@127.0.0.1:9"
    cmd = [sys.executable, "-m", "batchweave", "check", "s3://bucket/p", "--endpoint-url"]
    done = subprocess.run([*cmd, endpoint], capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert "http:/***@127.0.0.1:9" in done.stderr
    assert PASSWORD not in done.stdout + done.stderr


@pytest.mark.parametrize("cls", [S3Store, ObstoreS3Store])
def test_an_unreachable_endpoint_error_carries_no_secret(
    aws_env: pytest.MonkeyPatch, cls: type[S3Store] | type[ObstoreS3Store]
) -> None:
    aws_env.setenv("AWS_SECRET_ACCESS_KEY", SECRET)
    store = cls(
        "bucket",
        endpoint_url=f"http://127.0.0.1:{free_port()}",
        region="us-east-1",
        access_key_id="AK",
        secret_access_key=SECRET,
        session_token=SECRET + "-token",
        max_attempts=1,
        connect_timeout=1.0,
    )
    with pytest.raises(StoreUnavailable, match=r"127\.0\.0\.1") as info:
        store.get("k")
    assert SECRET not in "".join(traceback.format_exception(info.value))
    assert SECRET not in repr(store)
    assert SECRET not in store.url


@pytest.mark.parametrize("secret", [SECRET, f"p@{SECRET}"], ids=["plain", "with-at"])
def test_credentials_in_an_s3_url_are_refused_without_echoing_them(secret: str) -> None:
    # ``s3://key:secret@bucket`` put the secret into the bucket name, hence into ``url``.
    with pytest.raises(InvalidStoreURL, match=r"s3://\*\*\*@bucket") as info:
        open_store(f"s3://AKID:{secret}@bucket/prefix")
    assert SECRET not in "".join(traceback.format_exception(info.value))


@pytest.mark.parametrize(
    ("separator", "suffix"), [("//", ""), (";//", ""), (":/", ""), (":///", ""), (":/", "/a://b")]
)
@pytest.mark.parametrize("s3_client", ["boto3", "obstore"])
def test_credentials_in_an_s3_url_with_mistyped_slashes_are_not_echoed(
    separator: str, suffix: str, s3_client: str
) -> None:
    # Before: "store URL 's3//AKID:<secret>@bucket/prefix' has no scheme"; with a third slash
    # or a later '://' (where masking then started), "S3 URL ... has no bucket", secret and all.
    with pytest.raises(InvalidStoreURL, match=r"\*\*\*@bucket/prefix") as info:
        open_store(f"s3{separator}AKID:{SECRET}@bucket/prefix{suffix}", s3_client=s3_client)
    assert SECRET not in "".join(traceback.format_exception(info.value))


def test_credentials_in_a_store_url_without_a_scheme_are_not_echoed() -> None:
    with pytest.raises(InvalidStoreURL, match=r"'\*\*\*@bucket/prefix' has no scheme") as info:
        open_store(f"AKID:{SECRET}@bucket/prefix")
    assert SECRET not in "".join(traceback.format_exception(info.value))


# -- hostile manifests and segments ---------------------------------------------------------


@pytest.mark.parametrize(
    "nested", [b"[" * 100_000 + b"]" * 100_000, b'{"a":' * 50_000 + b"1"], ids=["array", "object"]
)
def test_deeply_nested_json_is_a_format_error(nested: bytes) -> None:
    # Before the audit the format peek after pydantic's refusal raised RecursionError.
    with pytest.raises(FormatError, match="deep-key"):
        decode_manifest(envelope(nested), key="deep-key")
    with pytest.raises(FormatError, match="deep-key"):
        decode_segment(envelope(nested, "batchweave-segment"), key="deep-key")


def test_a_deeply_nested_tensor_header_is_a_format_error() -> None:
    header = b"[" * 5_000 + b"]" * 5_000
    slice_ = len(header).to_bytes(8, "little") + header
    with pytest.raises(FormatError, match="invalid tensor slice"):
        get_codec("tensors").decode(slice_)


def test_deeply_nested_sample_ids_are_a_format_error() -> None:
    # The writer refuses such metadata now; an object from an older writer may still hold it.
    footer = encode_tgb([b"a", b"b"], Mesh(dp=2)).footer
    nested = footer.model_copy(update={"metadata": {SAMPLE_IDS_KEY: "[" * 5_000 + "]" * 5_000}})
    with pytest.raises(FormatError, match="is not JSON"):
        _sample_ids(nested, "k")


@pytest.mark.parametrize(
    "url",
    [
        "s3://bkt/p?endpoint_url=http://u:PWSECRET@127.0.0.1:9",
        "file://u:PWSECRET@host/x",
        "ftp://u:PWSECRET@host/x",
        "file:///x#PWSECRET",
    ],
)
def test_store_url_errors_do_not_echo_credentials_or_queries(url: str) -> None:
    with pytest.raises(InvalidStoreURL) as info:
        open_store(url)
    assert "PWSECRET" not in str(info.value)


# -- metrics ----------------------------------------------------------------------------------


def test_the_metrics_endpoint_listens_on_loopback_only() -> None:
    with start_metrics_server(0) as server:
        assert server._server.server_address[0] == "127.0.0.1"


@pytest.mark.parametrize("bad", ["../other-ns/data/x.tgb", "/abs/x.tgb", "data//x.tgb"])
def test_a_manifest_naming_a_key_outside_its_namespace_is_refused(bad: str) -> None:
    store = MemoryStore()
    with Producer(store, "ns", producer_id="p", mesh=Mesh(dp=1), policy="naive") as producer:
        producer.append([b"x"], offset=0)
    key = sorted(m.key for m in store.list("ns/_manifests/"))[-1]
    raw = body(store.get(key))
    good = next(m.key for m in store.list("ns/data/"))[len("ns/") :]
    assert good.encode() in raw
    hostile = raw.replace(good.encode(), bad.encode())
    # Before: decoded, and the read failed later with InvalidKey naming only the store key.
    with pytest.raises(FormatError, match=key):
        decode_manifest(envelope(hostile), key=key)
