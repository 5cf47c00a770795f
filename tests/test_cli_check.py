"""``batchweave check STORE``: every check on real stores, failing stores, JSON, cleanup, errors.

A store passes on ``file://``, moto and SeaweedFS and leaves nothing behind; a store that ignores
conditional writes (a wrapper injected where the command opens its store) fails with exit 1 and
says what to do; an interrupted check still removes its scratch prefix; an unreachable endpoint
is the CLI's usual one-line error (exit 2); credentials never appear in the output.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import threading
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import pytest
from cli_helpers import run_on_terminal
from click.testing import CliRunner, Result

import batchweave as bw
from batchweave import ObjectMeta, PutMode, StoreWrapper
from batchweave._policy import dac_gap
from batchweave.cli import _app, _check
from batchweave.cli._app import EXIT_FAILED, EXIT_INTERRUPTED, EXIT_TERMINATED, cli
from batchweave.cli._check import SCRATCH_PREFIX, check_store
from batchweave.cli._common import Terminated, open_cli_store
from batchweave.testing import S3Endpoint, free_port

CHECKS = [
    "conditional create",
    "overwrite",
    "get",
    "ranged get",
    "suffix range",
    "get_range_into",
    "head",
    "list order and start_after",
    "list order across directories",
    "delete",
    "delete missing",
    "concurrent create race",
    "cleanup",
]
SECRET = "bw-check-secret-7f3a9c2e51"
"""A secret long enough to be recognisable: it must appear in no output."""


def invoke(*args: str) -> Result:
    return CliRunner().invoke(cli, list(args))


@pytest.fixture
def root(tmp_path: Path) -> Path:
    path = tmp_path / "store"
    path.mkdir()
    return path


def leftovers(root: Path) -> list[Path]:
    """Every file under ``root``, and every directory but the store's own (empty) temp dir."""
    return [p for p in root.rglob("*") if p.name != ".bw-tmp"]


def inject(
    monkeypatch: pytest.MonkeyPatch, wrap: Callable[[bw.ObjectStore], bw.ObjectStore]
) -> None:
    """Make the CLI wrap the store it opens (how a misbehaving server is simulated)."""

    def opened(location: str, options: dict[str, Any], *, writes: bool) -> bw.ObjectStore:
        return wrap(open_cli_store(location, options, writes=writes))

    monkeypatch.setattr(_app, "_open", opened)


class IgnoresConditionalWrites(StoreWrapper):
    """A store like those that ignore ``If-None-Match: *``: every create overwrites."""

    def put(self, key: str, data: bytes | memoryview, *, mode: PutMode = PutMode.OVERWRITE) -> None:
        self.inner.put(key, data, mode=PutMode.OVERWRITE)


class InterruptedAtPut(StoreWrapper):
    """Raises ``error`` (Ctrl-C, SIGTERM) at the ``at``-th put, after earlier ones landed."""

    def __init__(self, inner: bw.ObjectStore, at: int, error: type[BaseException]) -> None:
        super().__init__(inner)
        self.puts, self.at, self.error = 0, at, error

    def put(self, key: str, data: bytes | memoryview, *, mode: PutMode = PutMode.OVERWRITE) -> None:
        self.puts += 1
        if self.puts == self.at:
            raise self.error
        self.inner.put(key, data, mode=mode)


class ListsInReverse(StoreWrapper):
    """A listing out of key order: version discovery would pick the wrong manifest."""

    def list(self, prefix: str = "", *, start_after: str | None = None) -> Iterator[ObjectMeta]:
        return iter(
            sorted(self.inner.list(prefix, start_after=start_after), key=lambda m: m.key)[::-1]
        )


class ListsLikeSeaweedFS(StoreWrapper):
    """Keys under a directory before siblings that sort lower bytewise (docs/store.md)."""

    def list(self, prefix: str = "", *, start_after: str | None = None) -> Iterator[ObjectMeta]:
        listed = self.inner.list(prefix, start_after=start_after)
        return iter(sorted(listed, key=lambda m: m.key.replace("/", "\x00")))


# -- passing stores -----------------------------------------------------------------------------


def test_a_file_store_passes_and_nothing_is_left_behind(root: Path) -> None:
    result = invoke("check", str(root), "--requests", "5")
    assert result.exit_code == 0, result.output
    text = " ".join(result.output.split())
    for name in CHECKS:
        assert name in text
    assert "FAIL" not in text
    assert f"OK: {root.as_uri()} can carry BatchWeave" in text
    assert "p50" in text
    assert "DAC (docs/dac.md): fragile window W" in text
    assert leftovers(root) == []
    assert list(bw.open_store(root.as_uri()).list("")) == []


def test_json_has_every_check_latency_and_the_dac_estimate(root: Path) -> None:
    result = invoke("check", root.as_uri(), "--json", "--requests", "4")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["ok"] is True
    assert data["failed"] == []
    assert data["store"] == root.as_uri()
    assert data["scratch"].startswith(SCRATCH_PREFIX)
    assert [c["name"] for c in data["checks"]] == CHECKS
    assert all(c["ok"] and c["status"] == "ok" and c["detail"] for c in data["checks"])
    operations = [x["operation"] for x in data["latency"]]
    assert operations == [
        "PUT 1 KB",
        "conditional PUT 1 KB",
        "GET 100 KB",
        "GET missing key (commit probe)",
        "HEAD",
        "LIST 12 keys",
    ]
    for x in data["latency"]:
        assert x["requests"] == 4
        assert x["error"] is None
        assert 0 <= x["p50_ms"] <= x["p95_ms"]
    assert data["dac"]["window_ms"] > 0
    assert leftovers(root) == []


def test_latency_percentiles_and_the_dac_line_follow_the_injected_clock(root: Path) -> None:
    ticks = iter(range(10**6))

    def clock() -> float:  # every request takes exactly 1 ms
        return next(ticks) / 1000

    report = check_store(bw.open_store(root.as_uri()), requests=7, clock=clock)
    assert report.ok
    assert {(x.p50_ms, x.p95_ms, x.requests) for x in report.latency} == {(1.0, 1.0, 7)}
    dac = report.dac
    assert dac is not None
    window = 0.002  # the probe GET + the conditional PUT
    assert dac.window_ms == pytest.approx(window * 1000)
    assert dac.lone_producer_period_ms == pytest.approx((window + dac_gap(window, 1)) * 1000)
    assert dac.lone_producer_period_ms == pytest.approx(20.0)  # W / duty, docs/dac.md
    k = -math.log(1 - 0.1)
    assert dac.namespace_commits_per_second == pytest.approx(0.9 * k / window, rel=1e-3)


@pytest.mark.moto_server
def test_a_moto_server_passes_without_showing_credentials(
    moto_endpoint: S3Endpoint, s3_bucket: str, s3_prefix: str, aws_env: pytest.MonkeyPatch
) -> None:
    aws_env.setenv("AWS_ACCESS_KEY_ID", moto_endpoint.access_key_id)
    aws_env.setenv("AWS_SECRET_ACCESS_KEY", SECRET)  # moto accepts any secret
    aws_env.setenv("AWS_DEFAULT_REGION", moto_endpoint.region)
    url = f"s3://{s3_bucket}/{s3_prefix}"
    args = ["check", url, "--endpoint-url", moto_endpoint.endpoint_url, "--requests", "5"]
    tables = invoke(*args)
    assert tables.exit_code == 0, tables.output
    assert "can carry BatchWeave" in tables.output
    result = invoke(*args, "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["ok"] is True, data["failed"]
    assert [c["name"] for c in data["checks"]] == CHECKS
    assert data["store"] == url
    for output in (tables.output, result.output):
        assert SECRET not in output
    listed = moto_endpoint.client().list_objects_v2(Bucket=s3_bucket, Prefix=s3_prefix)
    assert listed.get("KeyCount", 0) == 0


@pytest.mark.seaweedfs
def test_seaweedfs_passes(
    seaweedfs_endpoint: S3Endpoint, s3_bucket: str, s3_prefix: str, aws_env: pytest.MonkeyPatch
) -> None:
    aws_env.setenv("AWS_ACCESS_KEY_ID", seaweedfs_endpoint.access_key_id)
    aws_env.setenv("AWS_SECRET_ACCESS_KEY", seaweedfs_endpoint.secret_access_key)
    aws_env.setenv("AWS_DEFAULT_REGION", seaweedfs_endpoint.region)
    url = f"s3://{s3_bucket}/{s3_prefix}"
    endpoint = seaweedfs_endpoint.endpoint_url
    result = invoke("check", url, "--endpoint-url", endpoint, "--requests", "3", "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["ok"] is True, data["failed"]
    # SeaweedFS lists in file-system walk order across directories: a warning, not a failure.
    order = next(c for c in data["checks"] if c["name"] == "list order across directories")
    assert order["required"] is False
    assert seaweedfs_endpoint.secret_access_key not in result.output
    listed = seaweedfs_endpoint.client().list_objects_v2(Bucket=s3_bucket, Prefix=s3_prefix)
    assert listed.get("KeyCount", 0) == 0


# -- failing stores -----------------------------------------------------------------------------


def test_a_store_that_ignores_conditional_writes_fails_with_exit_1_and_says_what_to_do(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    inject(monkeypatch, IgnoresConditionalWrites)
    result = invoke("check", str(root), "--requests", "3")
    assert result.exit_code == EXIT_FAILED, result.output
    text = " ".join(result.output.split())
    assert "FAIL conditional create:" in text
    assert "it ignores conditional writes (If-None-Match: *)" in text
    assert "upgrade this one" in text
    assert "FAIL concurrent create race:" in text
    assert "8 of 8 concurrent creates of one key succeeded" in text
    assert "FAILED: 2 required check(s) failed (conditional create, concurrent create race)" in text
    assert "DAC (docs/dac.md)" not in text  # no commit estimate for a store commits cannot use
    assert leftovers(root) == []


def test_json_of_a_failing_store_names_the_failed_checks(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    inject(monkeypatch, IgnoresConditionalWrites)
    result = invoke("check", str(root), "--json", "--requests", "2")
    assert result.exit_code == EXIT_FAILED
    data = json.loads(result.stdout)
    assert data["ok"] is False
    assert data["failed"] == ["conditional create", "concurrent create race"]
    assert [c["name"] for c in data["checks"]] == CHECKS
    first = data["checks"][0]
    assert first["status"] == "FAIL"
    assert "accepted a second create-if-absent" in first["detail"]
    assert data["dac"] is None


def test_the_check_function_refuses_a_store_that_ignores_conditional_writes(root: Path) -> None:
    report = check_store(IgnoresConditionalWrites(bw.open_store(root.as_uri())), requests=1)
    assert not report.ok
    assert [c.name for c in report.failed] == ["conditional create", "concurrent create race"]
    assert "If-None-Match" in report.failed[0].detail
    assert leftovers(root) == []


def test_a_listing_out_of_key_order_fails(root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    inject(monkeypatch, ListsInReverse)
    result = invoke("check", str(root), "--json", "--requests", "1")
    assert result.exit_code == EXIT_FAILED
    data = json.loads(result.stdout)
    assert data["failed"] == ["list order and start_after"]
    detail = data["checks"][CHECKS.index("list order and start_after")]["detail"]
    assert "gave in another order" in detail
    assert "finds the newest manifest version by listing" in detail


def test_seaweedfs_cross_directory_order_is_a_warning_not_a_failure(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    inject(monkeypatch, ListsLikeSeaweedFS)
    result = invoke("check", str(root), "--requests", "1")
    assert result.exit_code == 0, result.output
    text = " ".join(result.output.split())
    assert "warn" in text
    assert "can carry BatchWeave" in text
    data = json.loads(invoke("check", str(root), "--json", "--requests", "1").stdout)
    order = data["checks"][CHECKS.index("list order across directories")]
    assert order["status"] == "warn"
    assert "does not rely on it" in order["detail"]


# -- interruption and errors --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("error", "status"),
    [(KeyboardInterrupt, EXIT_INTERRUPTED), (Terminated, EXIT_TERMINATED)],
    ids=["ctrl-c", "sigterm"],
)
@pytest.mark.parametrize("at", [3, 12, 40])
def test_an_interrupted_check_removes_its_scratch_prefix(
    root: Path,
    monkeypatch: pytest.MonkeyPatch,
    error: type[BaseException],
    status: int,
    at: int,
) -> None:
    inject(monkeypatch, lambda store: InterruptedAtPut(store, at, error))
    result = invoke("check", str(root), "--requests", "2")
    assert result.exit_code == status, result.output
    assert "the command is safe to run again" in result.output
    assert leftovers(root) == []


def test_the_cleanup_of_a_run_that_went_well_waits_as_long_as_every_other_check(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The final cleanup ran through the probe client (``probe_timeout`` per answer, no retry
    of a timeout): a store slower than that at deleting failed ``check`` after every check
    passed. Only the cleanup after a failure or an interrupt needs the short wait."""
    used: list[str] = []

    @contextlib.contextmanager
    def probe_view(store: bw.ObjectStore) -> Iterator[bw.ObjectStore]:
        used.append("probe view")
        raise bw.StoreTimeout("the probe client did not get an answer within probe_timeout")
        yield store  # pragma: no cover

    monkeypatch.setattr(_check, "_answering_within_probe_timeout", probe_view)
    report = check_store(bw.open_store(root.as_uri()), requests=2)
    assert all(result.ok for result in report.checks)
    assert used == []
    assert leftovers(root) == []


def test_the_check_function_cleans_up_before_an_interrupt_goes_on(root: Path) -> None:
    store = InterruptedAtPut(bw.open_store(root.as_uri()), 20, KeyboardInterrupt)
    with pytest.raises(KeyboardInterrupt):
        check_store(store, requests=2)
    assert store.puts == 20  # it did write before the interrupt
    assert leftovers(root) == []


def test_an_unreachable_endpoint_is_the_usual_one_line_error(aws_env: pytest.MonkeyPatch) -> None:
    aws_env.setenv("AWS_ACCESS_KEY_ID", "AKIACHECKTEST")
    aws_env.setenv("AWS_SECRET_ACCESS_KEY", SECRET)
    endpoint = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    result = invoke("check", "s3://bucket/runs", "--endpoint-url", endpoint)
    assert result.exit_code == 2, result.output
    assert result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith("batchweave: error: StoreUnavailable: ")
    assert f"{endpoint} is unreachable" in lines[0]
    assert SECRET not in result.output


def test_a_missing_directory_and_memory_urls_are_refused(tmp_path: Path) -> None:
    missing = invoke("check", str(tmp_path / "nope"))
    assert missing.exit_code == 2
    assert "no store directory at" in missing.output
    assert not (tmp_path / "nope").exists()
    memory = invoke("check", "memory://x")
    assert memory.exit_code == 2
    assert "exist only inside the one process" in " ".join(memory.output.split())


def test_progress_is_drawn_on_a_terminal_only(root: Path) -> None:
    status, stdout, terminal = run_on_terminal("check", str(root), "--requests", "2")
    assert status == 0, (stdout, terminal)
    assert "checking" in terminal
    assert "checking" not in stdout
    assert os.listdir(root) in ([], [".bw-tmp"])


class DeniesAt(StoreWrapper):
    """Credentials that may not do ``operation`` (``put`` or ``delete_many``)."""

    def __init__(self, inner: bw.ObjectStore, operation: str) -> None:
        super().__init__(inner)
        self.operation = operation

    def _deny(self, operation: str) -> None:
        if operation == self.operation:
            raise bw.AccessDenied(f"cannot {operation} in {self.url}: AccessDenied (test)")

    def put(self, key: str, data: bytes | memoryview, *, mode: PutMode = PutMode.OVERWRITE) -> None:
        self._deny("put")
        self.inner.put(key, data, mode=mode)

    def delete_many(self, keys: Iterable[str]) -> None:
        self._deny("delete_many")
        self.inner.delete_many(keys)


def test_credentials_that_cannot_write_are_the_usual_error(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    inject(monkeypatch, lambda store: DeniesAt(store, "put"))
    result = invoke("check", str(root))
    assert result.exit_code == 2, result.output
    assert result.stderr.startswith("batchweave: error: AccessDenied: cannot put in ")
    assert "warning" not in result.stderr  # nothing was written, so no cleanup was tried


def test_credentials_that_cannot_delete_fail_the_delete_checks_and_name_the_prefix(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    inject(monkeypatch, lambda store: DeniesAt(store, "delete_many"))
    result = invoke("check", str(root), "--json", "--requests", "1")
    assert result.exit_code == EXIT_FAILED, result.output
    data = json.loads(result.stdout)
    assert data["failed"] == ["delete", "delete missing", "cleanup"]
    cleanup = data["checks"][-1]["detail"]
    assert cleanup.startswith(f"removing {data['scratch']} failed: AccessDenied")
    assert cleanup.endswith("delete the objects under that prefix by hand")


class DeniesReads(StoreWrapper):
    """Write-only credentials (an upload role): every GET is refused."""

    def get(self, key: str) -> bytes:
        raise bw.AccessDenied(f"cannot get {key!r} in {self.url}: AccessDenied (test)")


def test_credentials_that_cannot_read_are_the_usual_error_and_leave_nothing_behind(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The first check's creates land before its GET is refused: they are removed too.
    inject(monkeypatch, DeniesReads)
    result = invoke("check", str(root))
    assert result.exit_code == 2, result.output
    assert result.stderr.startswith("batchweave: error: AccessDenied: cannot get ")
    assert "warning" not in result.stderr
    assert leftovers(root) == []


class UnavailableAt(StoreWrapper):
    """The endpoint stops answering at the ``at``-th put, after earlier ones landed."""

    def __init__(self, inner: bw.ObjectStore, at: int) -> None:
        super().__init__(inner)
        self.puts, self.at = 0, at

    def put(self, key: str, data: bytes | memoryview, *, mode: PutMode = PutMode.OVERWRITE) -> None:
        self.puts += 1
        if self.puts >= self.at:
            raise bw.StoreUnavailable(f"cannot put {key!r} in {self.url}: unreachable (test)")
        self.inner.put(key, data, mode=mode)


def test_an_endpoint_lost_after_the_first_check_names_the_objects_left_behind(root: Path) -> None:
    # The conditional-create check wrote its object (2 puts); the overwrite check then finds
    # the endpoint gone: no cleanup is tried, and the error says where the object is.
    store = UnavailableAt(bw.open_store(root.as_uri()), 3)
    with pytest.raises(bw.StoreUnavailable) as info:
        check_store(store, requests=1)
    left = leftovers(root)
    assert any(p.is_file() for p in left)
    assert f"may remain under {SCRATCH_PREFIX}" in str(info.value)


# -- an endpoint that stops answering mid-run ---------------------------------------------------


def read_timeout(op: str, key: str) -> BaseException:
    return bw.StoreTimeout(f"{op} {key!r}: did not answer within read_timeout=1 s (test)")


def write_timeout(op: str, key: str) -> BaseException:
    exc = bw.AmbiguousWriteError(f"{op} {key!r}: did not answer within read_timeout=1 s (test)")
    exc.timed_out = True
    return exc


class StopsAnswering(StoreWrapper):
    """An endpoint that stops answering at the first ``operation`` on a key holding ``marker``:
    that request and every later one time out (``error``), as on a hung server. Requests made
    after that are recorded in ``after`` (a cleanup that should not have been tried)."""

    def __init__(
        self,
        inner: bw.ObjectStore,
        operation: str,
        marker: str,
        error: Callable[[str, str], BaseException] = read_timeout,
    ) -> None:
        super().__init__(inner)
        self.operation, self.marker, self.error = operation, marker, error
        self.silent = False
        self.first = ""
        self.after: list[str] = []
        self.lock = threading.Lock()

    def _request(self, op: str, key: str) -> None:
        with self.lock:
            if self.silent:
                self.after.append(f"{op} {key}")
                raise self.error(op, key)
            if op == self.operation and self.marker in key:
                self.silent = True
                self.first = f"{op} {key}"
                raise self.error(op, key)

    def put(self, key: str, data: bytes | memoryview, *, mode: PutMode = PutMode.OVERWRITE) -> None:
        self._request("put", key)
        self.inner.put(key, data, mode=mode)

    def get(self, key: str) -> bytes:
        self._request("get", key)
        return self.inner.get(key)

    def get_range(self, key: str, rng: Any) -> bytes:
        self._request("get_range", key)
        return self.inner.get_range(key, rng)

    def head(self, key: str) -> ObjectMeta:
        self._request("head", key)
        return self.inner.head(key)

    def list(self, prefix: str = "", *, start_after: str | None = None) -> Iterator[ObjectMeta]:
        self._request("list", prefix)
        return self.inner.list(prefix, start_after=start_after)

    def delete_many(self, keys: Iterable[str]) -> None:
        keys = list(keys)
        self._request("delete_many", keys[0] if keys else "")
        self.inner.delete_many(keys)


# Where the endpoint goes silent: a check (a read, a write, a delete), the race's threads, the
# latency measurements, and the final cleanup. Before, each timeout was a FAIL row or a failed
# latency row and the run went on (each further request waiting as long again in the CLI, 60 s
# x 5 attempts), its cleanup too, and the store was reported as failing checks (exit 1).
SILENT_AT = {
    "ranged-get-read": ("get_range", "/object", read_timeout),
    "overwrite-write": ("put", "/overwrite", write_timeout),
    "delete": ("delete_many", "/delete", read_timeout),
    "race-write": ("put", "/race/", write_timeout),
    "latency-read": ("head", "/object", read_timeout),
    "latency-write": ("put", "/latency/create-", write_timeout),
    "final-cleanup": ("list", "check-", read_timeout),
}


@pytest.mark.parametrize("where", list(SILENT_AT))
def test_an_endpoint_that_stops_answering_stops_the_check_with_exit_2_naming_the_prefix(
    root: Path, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    operation, marker, error = SILENT_AT[where]
    stores: list[StopsAnswering] = []

    def silent(store: bw.ObjectStore) -> bw.ObjectStore:
        stores.append(StopsAnswering(store, operation, marker, error))
        return stores[-1]

    inject(monkeypatch, silent)
    result = invoke("check", str(root), "--requests", "2")
    assert result.exit_code == 2, result.output  # the store could not be checked: not exit 1
    assert result.stdout == ""  # no table of FAIL rows
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, lines
    line = lines[0]
    assert line.startswith("batchweave: error: StoreTimeout: "), line
    if error is write_timeout:
        assert "AmbiguousWriteError" in line
    scratch = next(p for p in root.rglob("check-*") if p.is_dir())
    assert f"may remain under _batchweave/{scratch.name}/ in {root.as_uri()}" in line
    assert "delete them once the store answers" in line
    assert "warning" not in result.stderr
    [store] = stores
    # Stopped at the first timeout: no further request, no cleanup. (The race's other threads
    # sent their creates of the same key at the same moment.)
    assert [r for r in store.after if r != store.first] == []
    assert any(p.is_file() for p in leftovers(root))  # left for the operator, as the line says


def test_the_check_function_raises_store_timeout_without_a_cleanup(root: Path) -> None:
    store = StopsAnswering(bw.open_store(root.as_uri()), "get_range", "/object")
    with pytest.raises(bw.StoreTimeout) as info:
        check_store(store, requests=1)
    assert store.after == []
    assert f"may remain under {SCRATCH_PREFIX}" in str(info.value)
    assert "the check stopped at the first request the endpoint did not answer" in str(info.value)


def test_a_write_that_failed_without_timing_out_is_still_a_failed_check(root: Path) -> None:
    # Only a timed-out write means the endpoint stopped answering; an ambiguous write after a
    # reset or a 5xx is the store's failure, one row, and the run goes on and cleans up.
    def reset(op: str, key: str) -> BaseException:
        return bw.AmbiguousWriteError(f"{op} {key!r}: connection reset (test)")

    class OneReset(StopsAnswering):
        def _request(self, op: str, key: str) -> None:
            if not self.silent and op == self.operation and self.marker in key:
                self.silent = True
                raise self.error(op, key)

    store = OneReset(bw.open_store(root.as_uri()), "put", "/overwrite", reset)
    report = check_store(store, requests=1)
    assert [c.name for c in report.failed] == ["overwrite"]
    assert "connection reset" in report.failed[0].detail
    assert leftovers(root) == []
