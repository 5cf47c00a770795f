"""Mistakes a new user makes, and the clear errors they must get.

Payloads of the wrong type, store URLs and endpoints missing a part, a URL string where a
store is expected, bad namespace or producer ids, CLI commands given a mistyped path (they must
not create a directory from it), the conditional-write probe after an ambiguous create, and an
example worker stopped while blocked. Each gets a BatchWeave error that says what was meant,
not a raw ``AttributeError`` or botocore ``ValueError`` or a misleading message.
"""

from __future__ import annotations

import logging
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from click.testing import CliRunner

import batchweave as bw
from batchweave._manifest._log import ManifestLog
from batchweave._store._open import ensure_conditional_writes
from batchweave.cli._app import cli
from batchweave.cli._common import open_cli_store
from batchweave.testing import free_port

NAMESPACE = "runs/audit"


def _producer(store: bw.ObjectStore, mesh: bw.Mesh, codec: str = "raw") -> bw.Producer:
    return bw.Producer(store, NAMESPACE, producer_id="prep-0", mesh=mesh, codec=codec)


# -- payloads of the wrong type ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("payload", "needle"),
    [
        ({"x": [1, 2, 3]}, "tensor 'x' is a list, not a numpy.ndarray"),
        ({"x": 5}, "tensor 'x' is a int, not a numpy.ndarray"),
        ({"x": b"abc"}, "tensor 'x' is a bytes, not a numpy.ndarray"),
        (np.zeros(3, dtype=np.float32), "stores a dict of str -> numpy.ndarray, got ndarray"),
    ],
)
def test_tensors_codec_refuses_non_arrays_with_a_type_error(payload: Any, needle: str) -> None:
    # Before: AttributeError ('list' object has no attribute 'ndim') from the sample count,
    # which looked inside the payload before the codec had checked its type.
    with pytest.raises(TypeError, match="codec 'tensors'") as info:
        bw.encode_tgb([payload], bw.Mesh(dp=1, cp=1), codec="tensors")
    assert needle in str(info.value)


def test_a_bad_slice_is_named_by_its_mesh_coordinates(store: bw.ObjectStore) -> None:
    mesh = bw.Mesh(dp=2, cp=2)
    slices: list[Any] = [{"x": np.zeros(2)} for _ in range(mesh.slices)]
    slices[2] = {"x": [0.0, 0.0]}
    with _producer(store, mesh, codec="tensors") as p:
        with pytest.raises(TypeError, match=r"^slice \(1, 0\): codec 'tensors'"):
            p.append(slices, offset=0)
        p.append([{"x": np.zeros(2)} for _ in range(mesh.slices)], offset=0)
    assert p.committed_offset == 0


@pytest.mark.parametrize(
    ("mesh", "codec", "payload"),
    [
        (bw.Mesh(dp=1, cp=1), "tensors", {"tokens": np.zeros(4, dtype=np.int32)}),
        (bw.Mesh(dp=2, cp=1), "raw", b"ab"),
        (bw.Mesh(dp=2, cp=1), "raw", "ab"),
    ],
)
def test_one_payload_instead_of_a_list_says_to_wrap_it(
    store: bw.ObjectStore, mesh: bw.Mesh, codec: str, payload: Any
) -> None:
    # Before: the payload itself was iterated as the slice list (a dict's keys, a bytes object's
    # ints), failing with "got str" for a dict or "got int" for bytes.
    with _producer(store, mesh, codec=codec) as p:
        with pytest.raises(TypeError, match="wrap a single payload in a list") as info:
            p.append(payload, offset=0)
        assert f"got one {type(payload).__name__}" in str(info.value)
        assert p.stats().pending == 0


# -- store URLs and endpoints ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("url", "needle"),
    [
        ("s3:/bucket/prefix", "did you mean 's3://bucket/prefix'?"),
        ("file:/data/weave", "did you mean 'file:///data/weave'?"),
        ("file:data/weave", "needs an absolute path"),
        ("memory:name", "did you mean 'memory://name'?"),
        ("/data/weave", "use 'file:///data/weave'"),
    ],
)
def test_a_url_missing_its_slashes_gets_the_url_that_was_meant(url: str, needle: str) -> None:
    # Before: "has no scheme" for every one of these, although most have one.
    with pytest.raises(bw.InvalidStoreURL) as info:
        bw.open_store(url)
    assert needle in str(info.value)


@pytest.mark.parametrize("s3_client", ["boto3", "obstore"])
@pytest.mark.parametrize("endpoint", ["127.0.0.1:9000", "localhost:9000", "http://", "ftp://h"])
def test_an_endpoint_without_http_scheme_is_an_invalid_store_url(
    endpoint: str, s3_client: str
) -> None:
    # Before (boto3): botocore's bare ValueError "Invalid endpoint: 127.0.0.1:9000", not a
    # BatchWeave error, so the CLI printed it without saying which option was wrong.
    with pytest.raises(bw.InvalidStoreURL, match=r"endpoint_url .* is not an http") as info:
        bw.open_store(
            "s3://bucket/prefix",
            endpoint_url=endpoint,
            access_key_id="AKIDAUDIT",
            secret_access_key="audit-secret-value",
            s3_client=s3_client,
            verify_conditional_writes=False,
        )
    assert "http://127.0.0.1:9000" in str(info.value)
    assert "audit-secret-value" not in str(info.value)


def test_a_valid_endpoint_is_accepted() -> None:
    store = bw.open_store(
        "s3://bucket/prefix",
        endpoint_url="https://s3.example.com:8443",
        verify_conditional_writes=False,
    )
    assert (
        repr(store) == "S3Store('s3://bucket/prefix', endpoint_url='https://s3.example.com:8443')"
    )
    store.close()


@pytest.mark.parametrize(
    "make",
    [
        lambda url: bw.Consumer(url, NAMESPACE, mesh=bw.Mesh(dp=1, cp=1), dp_rank=0, cp_rank=0),
        lambda url: bw.Producer(url, NAMESPACE, producer_id="p", mesh=bw.Mesh(dp=1, cp=1)),
        lambda url: bw.Watermarks(url, NAMESPACE),
        lambda url: bw.Reclaimer(url, NAMESPACE),
        lambda url: bw.retire_producers(url, NAMESPACE, idle_for=60),
    ],
    ids=["Consumer", "Producer", "Watermarks", "Reclaimer", "retire_producers"],
)
def test_a_url_string_instead_of_a_store_says_to_open_it(
    make: Callable[[Any], object], tmp_path: Path
) -> None:
    # Before: AttributeError: 'str' object has no attribute 'url' (or 'list').
    with pytest.raises(TypeError, match=r"open it first \(store = batchweave.open_store\(url\)\)"):
        make(tmp_path.as_uri())
    with pytest.raises(TypeError, match="expected an opened store, got the PosixPath"):
        make(tmp_path)


# -- the CLI -----------------------------------------------------------------------------------


def _cli(*args: str) -> Any:
    return CliRunner().invoke(cli, list(args), catch_exceptions=False)


@pytest.mark.parametrize("command", ["seal", "reclaim", "inspect", "verify"])
def test_cli_does_not_create_a_mistyped_store_directory(tmp_path: Path, command: str) -> None:
    # Before: seal and reclaim (which probe the store for writes) created the directory and its
    # temp dir, then reported NamespaceNotFound, leaving the typo on disk.
    typo = tmp_path / "wevae-data"
    result = _cli(command, str(typo), NAMESPACE)
    assert result.exit_code == 2
    assert f"no store directory at {typo} (it does not exist)" in result.stderr
    assert not typo.exists()


def test_cli_names_a_file_given_as_store_directory(tmp_path: Path) -> None:
    path = tmp_path / "notes.txt"
    path.write_text("not a store")
    result = _cli("inspect", str(path), NAMESPACE)
    assert result.exit_code == 2
    assert "(it is a file)" in result.stderr


@pytest.mark.parametrize(
    ("url", "needle"),
    [
        # Before: "no store directory at /store": the host part was silently dropped.
        ("file://weave-data/store", "names host 'weave-data'"),
        # Before: "no store directory at <cwd>/file:/abs/...": taken for a relative path.
        ("file:/abs/weave", "did you mean 'file:///abs/weave'?"),
        ("s3:/bucket/prefix", "did you mean 's3://bucket/prefix'?"),
    ],
)
def test_cli_explains_malformed_store_urls(tmp_path: Path, url: str, needle: str) -> None:
    result = _cli("inspect", url, NAMESPACE)
    assert result.exit_code == 2
    assert result.stderr.startswith("batchweave: error: InvalidStoreURL: ")
    assert needle in result.stderr


def test_only_the_demo_creates_a_store_directory(tmp_path: Path) -> None:
    target = tmp_path / "new" / "store"
    with pytest.raises(Exception, match="no store directory"):
        open_cli_store(str(target), {}, writes=True)
    assert not target.exists()
    store = open_cli_store(str(target), {}, writes=True, create=True)
    store.close()
    assert target.is_dir()


def test_export_refuses_an_empty_step_range(tmp_path: Path) -> None:
    # Before: "exported 0 rows" and exit 0 for --start 5 --stop 2.
    store = bw.open_store(tmp_path.as_uri())
    with _producer(store, bw.Mesh(dp=1, cp=1)) as p:
        p.append([b"x"], offset=0)
    dest = tmp_path / "history.parquet"
    result = _cli("export", str(tmp_path), NAMESPACE, str(dest), "--start", "5", "--stop", "2")
    assert result.exit_code == 2
    assert "--stop 2 must be greater than --start 5" in result.stderr
    assert not dest.exists()


def test_demo_does_not_warn_about_its_own_short_grace(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # Before: every first `batchweave demo` printed "Reclaimer grace 5 s is below 120 s ... use
    # a longer grace outside tests", about a setting the demo chose on purpose (docs/cli.md).
    from batchweave.cli._demo import _RECLAIM_GRACE, _demo_reclaimer

    store = bw.open_store(tmp_path.as_uri())
    lifecycle = logging.getLogger("batchweave.lifecycle")
    with caplog.at_level(logging.INFO, logger="batchweave.lifecycle"):
        reclaimer = _demo_reclaimer(store, NAMESPACE)
        assert reclaimer.grace == _RECLAIM_GRACE
        assert not [r for r in caplog.records if "grace" in r.getMessage()]
        assert lifecycle.level == logging.INFO  # restored
        bw.Reclaimer(store, NAMESPACE, grace=_RECLAIM_GRACE)  # a user's own short grace warns
    assert [r for r in caplog.records if "grace" in r.getMessage()]


# -- the conditional-write probe after an ambiguous create -------------------------------------


class _AmbiguousFirstCreate(bw.StoreWrapper):
    """The first create-if-absent fails ambiguously; ``lands`` says whether it was stored."""

    def __init__(self, inner: bw.ObjectStore, *, lands: bool) -> None:
        super().__init__(inner)
        self.lands = lands
        self.failed = False

    def put(
        self, key: str, data: bytes | memoryview, *, mode: bw.PutMode = bw.PutMode.OVERWRITE
    ) -> None:
        if mode is bw.PutMode.CREATE and not self.failed:
            self.failed = True
            if self.lands:
                super().put(key, data, mode=mode)
            raise bw.AmbiguousWriteError(f"put_if_absent {key!r}: connection reset after send")
        super().put(key, data, mode=mode)


def test_probe_reads_back_an_ambiguous_create_that_landed() -> None:
    # Before: open_store failed with AmbiguousWriteError although the probe object was there.
    store = _AmbiguousFirstCreate(bw.MemoryStore(), lands=True)
    ensure_conditional_writes(store)
    assert store.failed
    assert list(store.list("_batchweave/")) == []  # the probe was cleaned up


def test_probe_keeps_the_ambiguity_when_the_create_did_not_land() -> None:
    store = _AmbiguousFirstCreate(bw.MemoryStore(), lands=False)
    with pytest.raises(bw.AmbiguousWriteError, match="connection reset after send"):
        ensure_conditional_writes(store)


def test_obstore_on_a_closed_port_is_unavailable_not_ambiguous() -> None:
    # Before: AmbiguousWriteError "... error sending request; the write may have landed, read it
    # back" for an endpoint that refused the connection (a mistyped port).
    port = free_port()
    with pytest.raises(bw.StoreUnavailable, match=f"127.0.0.1:{port} is unreachable") as info:
        bw.open_store(
            "s3://bucket/prefix",
            s3_client="obstore",
            endpoint_url=f"http://127.0.0.1:{port}",
            access_key_id="AKIDAUDIT",
            secret_access_key="audit-secret-value",
            max_attempts=1,
        )
    assert "audit-secret-value" not in str(info.value)


def test_obstore_without_credentials_says_so() -> None:
    # obstore falls back to EC2 instance metadata when no credentials are configured; off EC2
    # that fails, and the error must say credentials are missing (before: AmbiguousWriteError on
    # the probe's PUT). The message is injected: tests send nothing to 169.254.169.254.
    store = bw.ObstoreS3Store(
        "bucket",
        "prefix",
        endpoint_url=f"http://127.0.0.1:{free_port()}",
        access_key_id="AKIDAUDIT",
        secret_access_key="audit-secret-value",
    )
    failure = RuntimeError(
        "Generic S3 error: Error performing PUT http://169.254.169.254/latest/api/token in "
        "1ms - Server returned non-2xx status code: 403 Forbidden"
    )
    error = store._translate(failure, op="put_if_absent", key="_batchweave/probe-1")
    assert isinstance(error, bw.AccessDenied)
    assert "no usable AWS credentials" in str(error)
    assert "AWS_ACCESS_KEY_ID" in str(error)


# -- examples ----------------------------------------------------------------------------------


def test_producer_worker_stops_on_sigint_while_blocked_by_max_lag(tmp_path: Path) -> None:
    # Before: the worker's SIGINT/SIGTERM handler only set a flag that the loop checks between
    # appends, so a worker whose append waited for max_lag (no trainer recording watermarks)
    # ignored the signal forever; the docstring promised a clean stop.
    script = Path(__file__).resolve().parent.parent / "examples" / "producer_worker.py"
    store_dir = tmp_path / "store"
    argv = [sys.executable, str(script), "--store", str(store_dir), "--namespace", NAMESPACE]
    argv += ["--batches", "1000", "--max-lag", "3", "--seq-len", "32", "--rows", "4"]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        # max_lag=3 without watermarks: 4 TGBs get committed, the 5th append blocks.
        deadline = time.monotonic() + 60
        while _committed_steps(store_dir) < 4:
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "the worker never committed 4 steps"
            time.sleep(0.05)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, err
    assert "stopping at offset 4" in out
    assert "committed offset 3" in out


def _committed_steps(store_dir: Path) -> int:
    if not store_dir.is_dir():
        return 0
    store = bw.open_store(store_dir.as_uri(), verify_conditional_writes=False)
    try:
        return ManifestLog(store, NAMESPACE).latest().next_step
    except bw.NamespaceNotFound:
        return 0
    finally:
        store.close()


@pytest.mark.parametrize(
    ("make", "needle"),
    [
        (
            lambda s: bw.Producer(s, "ns", producer_id="prep\t3", mesh=bw.Mesh(dp=1)),
            "producer_id 'prep\\t3' cannot be used in object keys: ",
        ),
        (
            lambda s: bw.Producer(s, "job//42", producer_id="p", mesh=bw.Mesh(dp=1)),
            "namespace 'job//42' cannot be used in object keys: ",
        ),
        (
            lambda s: bw.Consumer(s, "", mesh=bw.Mesh(dp=1), dp_rank=0),
            "namespace '' cannot be used in object keys: ",
        ),
        (
            lambda s: bw.Watermarks(s, "../up"),
            "namespace '../up' cannot be used in object keys: ",
        ),
    ],
)
def test_a_bad_namespace_or_producer_id_is_named_as_such(
    make: Callable[[bw.ObjectStore], object], needle: str
) -> None:
    # The store's own message names only the object key, which the caller never wrote.
    store = bw.MemoryStore()
    with pytest.raises(bw.InvalidKey, match="^" + re.escape(needle)):
        make(store)
    assert list(store.list("")) == []  # refused before anything was written
