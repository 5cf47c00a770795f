"""Read-only commands against an S3 endpoint that accepts connections and never answers.

They skip the conditional-write probe (read-only credentials), so before they waited
``read_timeout`` (60 s) on each of ``max_attempts`` (5) attempts: minutes of silence, then a
``TransientStoreError`` with no advice. Now a reachability check through the probe's client
fails them within about ``--probe-timeout`` with ``StoreUnavailable`` naming the endpoint.
Only 127.0.0.1 is contacted.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_environment_errors import SECRET, _credentials, _everything_said, fake_endpoint

import batchweave as bw
from batchweave.cli import _common

PROBE_TIMEOUT = 0.5
BOUND = 15.0
"""Seconds a command may take: the interpreter's start and imports, then one 0.5 s wait."""


@pytest.mark.parametrize("command", ["inspect", "verify", "export"])
def test_a_read_only_command_gives_up_on_a_silent_endpoint_after_probe_timeout(
    aws_env: pytest.MonkeyPatch, tmp_path: Path, command: str
) -> None:
    aws_env.setenv("AWS_ACCESS_KEY_ID", "AKIDHUNGCLI")
    aws_env.setenv("AWS_SECRET_ACCESS_KEY", SECRET)
    aws_env.setenv("AWS_DEFAULT_REGION", "us-east-1")
    output = [str(tmp_path / "out.jsonl")] if command == "export" else []
    with fake_endpoint("silent") as silent:
        args = [command, "s3://bucket/p", "runs/x", *output, "--endpoint-url", silent.url]
        started = time.monotonic()
        try:
            proc = subprocess.run(
                [sys.executable, "-m", "batchweave.cli", *args, "--probe-timeout", "0.5"],
                capture_output=True,
                text=True,
                timeout=BOUND,
            )
        except subprocess.TimeoutExpired:  # subprocess.run killed it
            pytest.fail(f"batchweave {command} still waiting after {BOUND} s")
        elapsed = time.monotonic() - started
        assert silent.connections == 1  # one request, not retried
    assert proc.returncode == 2, proc.stderr
    said = proc.stderr
    assert "StoreUnavailable" in said
    assert silent.url in said
    assert "did not answer within 0.5 s" in said
    assert "--probe-timeout" in said  # what to change for a server that is only slow
    assert SECRET not in said + proc.stdout
    assert PROBE_TIMEOUT <= elapsed < BOUND


@pytest.mark.parametrize("client", ["boto3", "obstore"])
def test_the_reachability_check_is_bounded_by_probe_timeout_on_both_clients(
    aws_env: pytest.MonkeyPatch, client: str
) -> None:
    with fake_endpoint("silent") as silent:
        # Default read_timeout and max_attempts: 60 s x 5 for a request of the store itself.
        store = bw.open_store(
            "s3://bucket/p", s3_client=client, verify_conditional_writes=False,
            endpoint_url=silent.url, probe_timeout=PROBE_TIMEOUT, **_credentials(),
        )  # fmt: skip
        started = time.monotonic()
        with pytest.raises(bw.StoreUnavailable) as info:
            _common._check_reachable(store)
        assert PROBE_TIMEOUT <= time.monotonic() - started < 5.0
        assert silent.connections == 1
        assert silent.closed_by_client(timeout=5.0)
        store.close()
    assert silent.url in str(info.value)
    assert SECRET not in _everything_said(info.value)


@pytest.mark.parametrize("kind", ["web-page", "not-found-page"])
def test_the_reachability_check_passes_any_answer(aws_env: pytest.MonkeyPatch, kind: str) -> None:
    # A 404, a 403 (read-only credentials) or even a web page is an answer: the command's own
    # requests say what it means. The check writes nothing.
    with fake_endpoint(kind) as endpoint:
        store = bw.open_store(
            "s3://bucket/p", verify_conditional_writes=False, endpoint_url=endpoint.url,
            max_attempts=1, **_credentials(),
        )  # fmt: skip
        _common._check_reachable(store)
        store.close()
        assert [line.split()[0] for line in endpoint.request_lines] == ["HEAD"]
