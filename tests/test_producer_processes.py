"""Real processes on SeaweedFS: 8 producers, two SIGKILLed mid-commit and restarted.

Each worker (``tests/_producer_worker.py``) publishes offsets ``0..TOTAL-1`` of its own source.
Two victims block inside a manifest commit, one just before the conditional PUT is sent and one
just after it landed (the process never learns it succeeded), and are SIGKILLed there, then
restarted with the same producer ids. Afterwards every source offset of every producer must be
in the final manifest exactly once, on dense steps. The test synchronizes only on lines the
workers print; it never sleeps.
"""

from __future__ import annotations

import contextlib
import os
import selectors
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from batchweave._manifest._log import ManifestLog
from batchweave._store._open import open_store
from batchweave.testing import S3Endpoint

pytestmark = [pytest.mark.seaweedfs, pytest.mark.slow]

WORKERS = 8
TOTAL = 250
"""Source offsets per producer: 8 x 250 = 2,000 TGBs."""
FIRST_FLUSH = 20
HOLD_OFFSET = 40
"""Victims flush at FIRST_FLUSH and HOLD_OFFSET and block in the commit that covers the latter:
offsets up to FIRST_FLUSH are committed, those after HOLD_OFFSET not even appended."""
DEADLINE = 150.0
WORKER = Path(__file__).with_name("_producer_worker.py")


class Fleet:
    """Worker processes and the progress lines they print, read as events."""

    def __init__(self, endpoint: S3Endpoint, store_url: str, namespace: str, logs: Path) -> None:
        self.endpoint = endpoint
        self.store_url = store_url
        self.namespace = namespace
        self.logs = logs
        self.env = {
            **os.environ,
            "AWS_ACCESS_KEY_ID": endpoint.access_key_id,
            "AWS_SECRET_ACCESS_KEY": endpoint.secret_access_key,
            "AWS_DEFAULT_REGION": endpoint.region,
        }
        self.procs: dict[str, subprocess.Popen[str]] = {}
        self.lines: dict[str, list[str]] = {}
        self.selector = selectors.DefaultSelector()
        self.deadline = time.monotonic() + DEADLINE

    def start(self, pid: str, *, hold: str | None = None) -> None:
        cmd = [
            sys.executable,
            str(WORKER),
            "--store",
            self.store_url,
            "--endpoint-url",
            self.endpoint.endpoint_url,
            "--namespace",
            self.namespace,
            "--producer-id",
            pid,
            "--total",
            str(TOTAL),
        ]
        if hold is not None:
            cmd += ["--hold", hold, "--hold-offset", str(HOLD_OFFSET)]
            cmd += ["--flush-at", str(FIRST_FLUSH), "--flush-at", str(HOLD_OFFSET)]
        stderr = (self.logs / f"{pid}-{len(self.lines.get(pid, []))}.stderr").open("w")
        proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=stderr, text=True, env=self.env, bufsize=1
        )
        stderr.close()
        self.procs[pid] = proc
        self.lines.setdefault(pid, [])
        assert proc.stdout is not None
        self.selector.register(proc.stdout, selectors.EVENT_READ, pid)

    def wait_for(self, what: str, done: Callable[[], bool]) -> None:
        """Read worker output until ``done()`` holds; fail at the deadline or a crashed worker."""
        while not done():
            remaining = self.deadline - time.monotonic()
            if remaining <= 0:
                pytest.fail(f"timed out waiting for {what}; progress: {self.lines}")
            for key, _ in self.selector.select(timeout=remaining):
                pid = key.data
                line = key.fileobj.readline()  # type: ignore[union-attr]
                if line:
                    self.lines[pid].append(line.strip())
                    continue
                self.selector.unregister(key.fileobj)
                code = self.procs[pid].wait()
                if code != 0 and code != -signal.SIGKILL:
                    stderr = sorted(self.logs.glob(f"{pid}-*.stderr"))[-1].read_text()
                    pytest.fail(f"worker {pid} exited with {code}:\n{stderr[-3000:]}")

    def last(self, pid: str, prefix: str) -> list[str] | None:
        for line in reversed(self.lines[pid]):
            if line.startswith(prefix):
                return line.split()
        return None

    def kill(self, pid: str) -> None:
        proc = self.procs[pid]
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        assert proc.stdout is not None
        with contextlib.suppress(KeyError):  # already unregistered at end of output
            self.selector.unregister(proc.stdout)
        proc.stdout.close()

    def stop_all(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            if proc.stdout is not None:
                proc.stdout.close()
        self.selector.close()


@pytest.fixture
def fleet(
    seaweedfs_endpoint: S3Endpoint, s3_bucket: str, s3_prefix: str, tmp_path: Path
) -> Iterator[Fleet]:
    f = Fleet(seaweedfs_endpoint, f"s3://{s3_bucket}/{s3_prefix}", "run", tmp_path)
    try:
        yield f
    finally:
        f.stop_all()


def test_killed_producers_resume_exactly_once(fleet: Fleet) -> None:
    pids = [f"prep-{i}" for i in range(WORKERS)]
    before, after = pids[0], pids[1]
    fleet.start(before, hold="before")
    fleet.start(after, hold="after")
    for pid in pids[2:]:
        fleet.start(pid)

    fleet.wait_for(
        "both victims to block mid-commit",
        lambda: fleet.last(before, "hold") is not None and fleet.last(after, "hold") is not None,
    )
    held_before = int(fleet.last(before, "hold")[2])  # type: ignore[index]
    held_after = int(fleet.last(after, "hold")[2])  # type: ignore[index]
    fleet.kill(before)
    fleet.kill(after)

    # The victim killed after its PUT landed did commit: that version is in the history.
    store = open_store(fleet.store_url, **fleet.endpoint.store_options())
    log = ManifestLog(store, fleet.namespace)
    assert log.latest().producers[after].offset is not None
    states = [log.read(v).producers.get(after) for v in log.versions()]
    assert held_after in [s.offset for s in states if s is not None]
    assert held_before == held_after == HOLD_OFFSET

    fleet.start(before)
    fleet.start(after)
    fleet.wait_for(
        "the restarted victims to start",
        lambda: (
            len([ln for ln in fleet.lines[before] + fleet.lines[after] if "started" in ln]) == 4
        ),
    )
    _, epoch_b, resume_b = fleet.last(before, "started")  # type: ignore[misc]
    _, epoch_a, resume_a = fleet.last(after, "started")  # type: ignore[misc]
    first_epochs = [
        int(next(ln.split()[1] for ln in fleet.lines[pid] if ln.startswith("started")))
        for pid in (before, after)
    ]
    assert [int(epoch_b), int(epoch_a)] == [e + 1 for e in first_epochs]  # one restart each
    # The unacknowledged but landed commit counts; the one never sent does not.
    assert int(resume_a) == held_after + 1
    assert FIRST_FLUSH < int(resume_b) <= held_before

    fleet.wait_for(
        "every producer to finish", lambda: all(fleet.last(p, "done") is not None for p in pids)
    )
    for pid in pids:
        assert fleet.procs[pid].wait() == 0
        assert fleet.last(pid, "done")[:2] == ["done", str(TOTAL - 1)]  # type: ignore[index]

    final = log.latest()
    seen: dict[tuple[str, int], int] = {}
    for expected_step, (step, desc) in enumerate(log.descriptors(final, 0, final.next_step)):
        assert step == expected_step
        key = (desc.producer_id, desc.offset)
        assert key not in seen, f"{key} committed twice: steps {seen[key]} and {step}"
        seen[key] = step
    assert final.next_step == WORKERS * TOTAL
    assert set(seen) == {(pid, off) for pid in pids for off in range(TOTAL)}
    for pid in pids:
        assert final.producers[pid].offset == TOTAL - 1
    store.close()
    print({pid: fleet.last(pid, "done") for pid in pids})
