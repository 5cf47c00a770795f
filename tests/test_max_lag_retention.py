"""``max_lag`` against the checkpoints a trainer retains.

The reclamation boundary is the *oldest* live watermark. A trainer that keeps its last K
checkpoints (``Watermarks(keep_last=K)``) every C steps releases it only after its next
checkpoint, K x C steps past it, so producers held ``max_lag`` steps past the boundary must let
it read that far: ``max_lag`` below about K x C is a permanent stall. Before, nothing said so:
the producer logged INFO for ten minutes, the consumer's timeout told the user to check that
rank 0 calls ``checkpoint_hook`` (it did), ``batchweave demo --checkpoint-every 100`` (max_lag 60)
stalled and its summary still claimed every step, and ``examples/train_resume.py --every 20
--max-lag 30`` died with ``ConsumerTimeout`` after two minutes.
"""

from __future__ import annotations

import importlib.util
import io
import logging
import re
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fake_time import FakeTime
from rich.console import Console

from batchweave import (
    Consumer,
    ConsumerTimeout,
    Mesh,
    Producer,
    ProducerError,
    Watermark,
    Watermarks,
)
from batchweave._producer._lag import LAG_WARN_AFTER, LAG_WARN_STUCK, diagnose
from batchweave._store._memory import MemoryStore
from batchweave.cli._common import CliFailure
from batchweave.cli._demo import (
    DemoConfig,
    _check,
    _lag_problems,
    _RankLog,
    _Reclaiming,
    _Sampler,
    _summary,
)

NS = "run"
MESH = Mesh(dp=1, cp=1)
ROOT = Path(__file__).resolve().parent.parent


class _LagLines(logging.Handler):
    """The producer's "blocked by max_lag" lines; ``until`` fires on the first that matches."""

    def __init__(self, until: Any) -> None:
        super().__init__(logging.INFO)
        self.lines: list[logging.LogRecord] = []
        self.until = until
        self.done = threading.Event()

    def emit(self, record: logging.LogRecord) -> None:
        # The wait runs on fake time, so under load it may log on (to the ten-minute WARNING)
        # before the test releases it: what comes after ``until`` fired is not judged.
        if self.done.is_set():
            return
        if "blocked by max_lag" in record.getMessage():
            self.lines.append(record)
            if self.until(record):
                self.done.set()


@pytest.fixture
def lag_log() -> Iterator[Any]:
    handlers: list[_LagLines] = []
    logger = logging.getLogger("batchweave.producer")
    old_level = logger.level
    logger.setLevel(logging.INFO)

    def attach(until: Any) -> _LagLines:
        handler = _LagLines(until)
        logger.addHandler(handler)
        handlers.append(handler)
        return handler

    yield attach
    for handler in handlers:
        logger.removeHandler(handler)
    logger.setLevel(old_level)


def _waited(record: logging.LogRecord) -> float:
    return float(record.getMessage().split("waiting ")[1].split(" s")[0])


def _block(
    store: MemoryStore,
    fake: FakeTime,
    *,
    max_lag: int,
    marks: dict[str, int],
    hold: int | None,
    handler: _LagLines,
) -> None:
    """Publish until ``max_lag`` blocks, with ``marks`` live; wait for ``handler``; unblock.

    ``hold``: a watermark step that holds the boundary while publishing (then released), so
    more steps are visible than ``marks`` alone would let through.
    """
    setup = Watermarks(store, NS, clock=fake.wall)
    with Producer(
        store,
        NS,
        producer_id="p",
        mesh=MESH,
        policy="naive",
        max_lag=max_lag,
        lag_log_interval=5.0,
        **fake.producer_options(),  # type: ignore[arg-type]
    ) as p:
        boundary = min(marks.values()) if hold is None else hold
        if hold is not None:
            setup.record("hold", hold)
        else:
            for checkpoint_id, step in marks.items():
                setup.record(checkpoint_id, step)
        for offset in range(boundary + max_lag + 1):
            p.append([b"x" * 8], offset=offset)
        p.flush()
        if hold is not None:
            for checkpoint_id, step in marks.items():
                setup.record(checkpoint_id, step)
            setup.release("hold")
        blocked = threading.Thread(
            target=p.append, args=([b"x" * 8],), kwargs={"offset": boundary + max_lag + 1}
        )
        blocked.start()
        assert handler.done.wait(60), [r.getMessage() for r in handler.lines[-3:]]
        for checkpoint_id in marks:  # the trainer checkpoints: the boundary jumps past it all
            setup.release(checkpoint_id)
        setup.record("later", boundary + max_lag + 1)
        blocked.join(10)
        assert not blocked.is_alive()


KEEP_2_EVERY_10 = {"step-000010": 10, "step-000020": 20}
"""The watermarks of Watermarks(keep_last=2) after checkpoints at steps 10 and 20."""
TWO_READERS_IN_STEP = {"ref-000010": 10, "main-000010": 10, "ref-000020": 20, "main-000020": 20}
"""examples/train_resume.py: two trainers, each keeping its two newest checkpoints."""


@pytest.mark.parametrize("marks", [KEEP_2_EVERY_10, TWO_READERS_IN_STEP])
def test_a_max_lag_below_keep_last_intervals_is_diagnosed_at_warning_within_a_minute(
    lag_log: Any, marks: dict[str, int]
) -> None:
    # max_lag 15: producers stop at step 25, the trainer must read to step 29 to checkpoint at 30
    # and release step 10. Before, this wait said nothing at WARNING for ten minutes.
    store, fake = MemoryStore(), FakeTime(1000.0)
    handler = lag_log(lambda r: r.levelno == logging.WARNING)
    _block(store, fake, max_lag=15, marks=marks, hold=None, handler=handler)
    warnings = [r for r in handler.lines if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    text = warnings[0].getMessage()
    assert LAG_WARN_STUCK <= _waited(warnings[0]) < LAG_WARN_AFTER
    assert "max_lag 15" in text
    assert "This job cannot progress" in text
    oldest = min(marks, key=lambda k: (marks[k], k))
    assert f"oldest watermark {oldest!r} at step 10" in text
    assert re.search(r"newest watermark '\w+-000020' at step 20", text)
    assert "a checkpoint interval of about 10 steps" in text
    assert "Raise max_lag to at least 20" in text
    assert "keep_last x checkpoint interval" in text
    assert "keep fewer checkpoints" in text
    assert "checkpoint more often" in text
    # Every line of the wait carries the diagnosis; only one is a WARNING.
    assert all("This job cannot progress" in r.getMessage() for r in handler.lines)
    assert all(r.levelno == logging.INFO for r in handler.lines if r is not warnings[0])


@pytest.mark.parametrize(
    ("max_lag", "hold"),
    [
        (20, None),  # exactly keep_last x interval: producers publish step 30, enough
        (25, None),
        (15, 17),  # too small, but the steps to the next checkpoint are already published
    ],
)
def test_a_wait_training_can_end_is_not_called_a_stall(
    lag_log: Any, max_lag: int, hold: int | None
) -> None:
    store, fake = MemoryStore(), FakeTime(1000.0)
    handler = lag_log(lambda r: _waited(r) >= 3 * LAG_WARN_STUCK)
    _block(store, fake, max_lag=max_lag, marks=KEEP_2_EVERY_10, hold=hold, handler=handler)
    assert handler.lines
    assert not any("cannot progress" in r.getMessage() for r in handler.lines)
    assert all(r.levelno == logging.INFO for r in handler.lines)


def test_one_watermark_gives_no_interval_and_no_stall_claim(lag_log: Any) -> None:
    store, fake = MemoryStore(), FakeTime(1000.0)
    handler = lag_log(lambda r: _waited(r) >= 3 * LAG_WARN_STUCK)
    _block(store, fake, max_lag=5, marks={"step-000010": 10}, hold=None, handler=handler)
    assert not any("cannot progress" in r.getMessage() for r in handler.lines)


def test_a_watermark_from_a_clock_ahead_shows_no_negative_age() -> None:
    # Before: "recorded -3600 s ago" when the trainer's clock ran an hour ahead of the producer's.
    now = 1_800_000_000.0
    ahead = Watermark(checkpoint_id="ckpt-0", step=0, version=1, recorded_at=now + 3600)
    holder, _ = diagnose([ahead], 10, 5, now)
    assert "-3600" not in holder
    assert "recorded 3600 s in the future by this host's clock (clock skew?)" in holder
    # Ordinary skew of a few seconds is no news: clamped at 0, not flagged.
    slightly = ahead.model_copy(update={"recorded_at": now + 2})
    assert diagnose([slightly], 10, 5, now)[0].endswith("recorded 0 s ago")
    older = ahead.model_copy(update={"recorded_at": now - 12})
    assert diagnose([older], 10, 5, now)[0].endswith("recorded 12 s ago")


def test_a_clock_stepped_back_neither_shows_a_negative_wait_nor_postpones_the_warning(
    lag_log: Any,
) -> None:
    # Before: now - blocked_since, unclamped: "waiting -90 s so far" after the producer host's
    # clock stepped back 100 s (NTP), and the no-watermark WARNING came 100 s late.
    store, fake = MemoryStore(), FakeTime(1000.0)
    first_line: list[float] = []
    warned_at: list[float] = []

    def until(record: logging.LogRecord) -> bool:
        first_line[:] = first_line or [fake.clock()]
        if record.levelno == logging.WARNING:
            warned_at.append(fake.clock())
            return True
        return False

    def stepped() -> float:  # the producer's clock: stepped back 100 s at 1010
        now = fake.clock()
        return now - 100.0 if now >= 1010.0 else now

    handler = lag_log(until)
    options: dict[str, Any] = {**fake.producer_options(), "clock": stepped}
    with Producer(store, NS, producer_id="p", mesh=MESH, policy="naive", max_lag=2, **options) as p:
        for offset in range(3):
            p.append([b"x" * 8], offset=offset)
        p.flush()
        blocked = threading.Thread(target=p.append, args=([b"x" * 8],), kwargs={"offset": 3})
        blocked.start()
        assert handler.done.wait(60), [r.getMessage() for r in handler.lines[-3:]]
        Watermarks(store, NS, clock=fake.wall).record("later", 4)
        blocked.join(10)
        assert not blocked.is_alive()
    assert all(_waited(r) >= 0 for r in handler.lines), [r.getMessage() for r in handler.lines]
    assert fake.clock() >= 1010.0  # the clock did step back during the wait
    # The WARNING after a minute with no watermark, a minute after the wait began (give or take
    # the round the step fell in), not 100 s later.
    assert LAG_WARN_AFTER <= warned_at[0] - first_line[0] < LAG_WARN_AFTER + 10


# -- the consumer's timeout -------------------------------------------------------------------


def test_the_consumer_timeout_names_max_lag_against_the_retained_checkpoints() -> None:
    # Before: "check that rank 0 calls checkpoint_hook", which the stalled trainer did.
    store, fake = MemoryStore(), FakeTime(1000.0)
    with Producer(store, NS, producer_id="p", mesh=MESH, policy="naive") as p:
        p.append([b"x"], offset=0)
    c = Consumer(store, NS, mesh=MESH, dp_rank=0, timeout=1.0, clock=fake.clock, sleep=fake.sleep)
    next(c)
    with pytest.raises(ConsumerTimeout) as info:
        next(c)
    c.close()
    text = str(info.value)
    assert "max_lag must be at least the TGB steps from the oldest retained checkpoint" in text
    assert "keep_last x checkpoint interval" in text
    assert "log why they are blocked" in text
    assert "checkpoint_hook" in text


# -- batchweave demo --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("options", "needle"),
    [
        (
            {"checkpoint_every": 100},
            "--max-lag 60 is below --checkpoint-every 100 minus 1: each rank keeps only its last "
            "checkpoint's watermark",
        ),
        (
            {"checkpoint_every": 100},
            "use --max-lag 99 or more, or a --checkpoint-every of at most 61",
        ),
        ({"checkpoint_every": 62}, "use --max-lag 61 or more"),  # max_lag = checkpoint_every - 2
        ({"max_lag": 8}, "use --max-lag 9 or more, or a --checkpoint-every of at most 9"),
        ({"max_lag": 0}, "use --max-lag 9 or more, or a --checkpoint-every of at most 1"),
        (
            {"steps": 8, "producers": 1, "max_lag": 1, "checkpoint_every": 100},
            "no rank checkpoints within the 8 steps",
        ),
        (  # max_lag = total - 2
            {"steps": 8, "producers": 1, "max_lag": 6, "checkpoint_every": 100},
            "use --max-lag 7 or more, or a --checkpoint-every below 8",
        ),
        ({"steps": 8, "producers": 1, "max_lag": 6, "checkpoint_every": 8}, "use --max-lag 7 "),
    ],
)
def test_demo_refuses_a_max_lag_no_rank_could_checkpoint_past(
    options: dict[str, Any], needle: str
) -> None:
    with pytest.raises(CliFailure, match=re.escape(needle)):
        _check(DemoConfig(**options))


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"checkpoint_every": 60},
        {"checkpoint_every": 61},  # max_lag 60 = checkpoint_every - 1
        {"max_lag": 9},
        {"checkpoint_every": 1, "max_lag": 0},
        {"checkpoint_every": 100, "max_lag": 99},
        {"steps": 8, "producers": 1, "max_lag": 7, "checkpoint_every": 100},  # total - 1
        {"steps": 8, "producers": 1, "max_lag": 7, "checkpoint_every": 8},
    ],
)
def test_demo_accepts_a_max_lag_of_a_checkpoint_interval_minus_one(options: dict[str, Any]) -> None:
    # Before: max_lag = checkpoint_every - 1 was refused, though producers publish every step
    # up to boundary + max_lag (they block while visible - boundary > max_lag), which includes
    # the step before a rank's next checkpoint.
    _check(DemoConfig(**options))


def _steps_read(*, total: int, checkpoint_every: int, max_lag: int) -> int:
    """Steps a rank of the demo reads (one producer, one rank, keep_last 1) before it ends or
    stalls: it records its watermark at every ``checkpoint_every`` steps, as the demo does."""
    store = MemoryStore()
    marks = Watermarks(store, NS)
    marks.record("rank-0", 0)
    producer = Producer(
        store,
        NS,
        producer_id="p",
        mesh=MESH,
        policy="naive",
        max_lag=max_lag,
        backoff=lambda attempt: 0.005,  # re-reads the boundary promptly while blocked
    )

    def produce() -> None:
        try:
            for offset in range(total):
                producer.append([b"x" * 8], offset=offset)
            producer.flush()
        except ProducerError:  # aborted while blocked: the stall case
            pass

    thread = threading.Thread(target=produce)
    thread.start()
    consumer = Consumer(
        store, NS, mesh=MESH, dp_rank=0, timeout=3.0, poll_interval=0.005, max_poll_interval=0.02
    )
    read = 0
    try:
        for step, _ in consumer:
            read = step + 1
            if read % checkpoint_every == 0:
                marks.record("rank-0", read)
            if read == total:
                break
    except ConsumerTimeout:
        pass
    finally:
        producer.abort()
        thread.join(30)
        consumer.close()
    return read


@pytest.mark.parametrize(
    ("total", "checkpoint_every", "max_lag"),
    [(12, 4, 3), (12, 4, 2), (12, 12, 11), (12, 20, 11), (12, 20, 10)],
)
def test_the_demo_refuses_exactly_the_max_lags_that_stall_a_producer(
    total: int, checkpoint_every: int, max_lag: int
) -> None:
    # The demo's rule against the producer's real blocking, at the boundary values.
    config = DemoConfig(
        steps=total, producers=1, max_lag=max_lag, checkpoint_every=checkpoint_every
    )
    refused = bool(_lag_problems(config))
    read = _steps_read(total=total, checkpoint_every=checkpoint_every, max_lag=max_lag)
    assert (read < total) == refused, (read, refused)


def test_demo_cli_refuses_it_as_a_usage_error_before_starting(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "batchweave.cli", "demo", "--checkpoint-every", "100"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "--max-lag 60 is below --checkpoint-every 100" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert list(tmp_path.iterdir()) == []  # nothing was started


def _summary_text(tmp_path: Path, delivered: list[int], *, ok: bool) -> str:
    logs = []
    for rank, steps in enumerate(delivered):
        log = _RankLog(tmp_path / f"rank-{rank}.jsonl")
        log.delivered = steps
        logs.append(log)
    buffer = io.StringIO()
    out = Console(file=buffer, width=200, color_system=None)
    _summary(
        out,
        tmp_path,
        logs,
        360,
        60.0,
        _Sampler(MemoryStore(), NS),
        _Reclaiming(reclaimer=None),  # type: ignore[arg-type]
        [],
        report_ok=ok,
    )
    return buffer.getvalue()


def test_a_failed_demo_summary_counts_only_the_steps_it_delivered(tmp_path: Path) -> None:
    # Before: "360 x 4 ranks" (and 360 steps' throughput) after a stall at step 186.
    text = _summary_text(tmp_path, [186, 190, 186, 187], ok=False)
    assert "186 of 360 delivered to all 4 ranks in 60.0s (failed)" in text
    assert "360 x 4 ranks" not in text
    assert "3.1 steps/s" in text
    assert "360 x 4 ranks in 60.0s" in _summary_text(tmp_path, [360] * 4, ok=True)


# -- examples/train_resume.py -----------------------------------------------------------------


def _train_resume() -> Any:
    spec = importlib.util.spec_from_file_location(
        "train_resume_under_test", ROOT / "examples" / "train_resume.py"
    )
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--every", "20", "--max-lag", "30"], "--max-lag 30 must be at least 2 x --every (40)"),
        (["--every", "10", "--max-lag", "19"], "--max-lag 19 must be at least 2 x --every (20)"),
    ],
)
def test_train_resume_refuses_flags_that_cannot_progress(
    argv: list[str],
    needle: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    module = _train_resume()
    monkeypatch.setattr(module, "drive", lambda args: pytest.fail(f"started with {args}"))
    monkeypatch.setattr(sys, "argv", ["train_resume.py", *argv])
    with pytest.raises(SystemExit) as info:
        module.main()
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert needle in err
    assert "keeps its 2 newest checkpoints" in err


def test_train_resume_defaults_and_the_tested_flags_pass_the_check(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    module = _train_resume()
    started: list[Any] = []
    monkeypatch.setattr(module, "drive", lambda args: started.append(args) or 0)
    for argv in ([], ["--steps", "40", "--every", "5", "--max-lag", "15", "--kill-after", "15"]):
        monkeypatch.setattr(sys, "argv", ["train_resume.py", *argv])
        assert module.main() == 0
    assert len(started) == 2
