"""batchweave.torch when DataLoader workers or the training process die while workers wait.

A worker killed (the OOM killer's SIGKILL) while it waits for producers, and SIGTERM to the whole
job while workers wait, end the loop with torch's own "DataLoader worker ... exited unexpectedly"
error, and ``state_dict()`` still works: before, the loop's end set a multiprocessing ``Event``,
whose ``set()`` waits for every waiting process to acknowledge, and a dead one never does (the
training process hung for ever). Workers waiting for producers when the training process dies
stop instead of living on as orphans. A second loader over the same dataset starts at its first
step: a loader keeps its resume state to itself.

The training process is a subprocess (``trainer.py`` below) so that a hang fails the test instead
of hanging it. It prints its workers' pids once they are about to wait; the test then waits until
each worker's main thread blocks in its sleep (``/proc/<pid>/syscall``) before sending a signal.
Only the trainer and its workers are ever signalled, each by pid.
"""

from __future__ import annotations

import contextlib
import os
import platform
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from test_consumer import payload, produce
from test_consumer_torch import MESH

import batchweave
from batchweave import FileStore, Producer
from batchweave.torch import WeaveDataset, WeaveLoader

pytestmark = pytest.mark.skipif(
    not Path("/proc/self/syscall").exists(), reason="needs Linux /proc/<pid>/syscall"
)

TRAINER = """\
import multiprocessing, signal, sys, warnings
warnings.simplefilter("ignore")
from batchweave import Mesh
from batchweave.torch import WeaveDataset, WeaveLoader


def main() -> None:
    url, context, last = sys.argv[1], sys.argv[2], int(sys.argv[3])
    if "--catch-sigterm" in sys.argv:  # a trainer that checkpoints when preempted
        signal.signal(signal.SIGTERM, lambda *_: print("SIGTERM", flush=True))
    dataset = WeaveDataset(
        url, "run", mesh=Mesh(dp=2, cp=2), dp_rank=1, cp_rank=0,
        poll_interval=2, max_poll_interval=2,  # waiting workers spend their time asleep
    )
    loader = WeaveLoader(dataset, num_workers=2, multiprocessing_context=context)
    steps = iter(loader)
    try:
        for step, _ in steps:
            print("step", int(step), flush=True)
            if int(step) == last:  # both workers now wait for producers
                pids = [p.pid for p in multiprocessing.active_children()]
                print("workers", *pids, flush=True)
    except Exception as exc:
        print("loop ended:", type(exc).__name__, exc, flush=True)
    if "--retry" in sys.argv:  # once the test says the producers went on, retry the step
        print("children", len(multiprocessing.active_children()), flush=True)
        sys.stdin.readline()
        for step, _ in steps:
            print("step", int(step), flush=True)
        print("children", len(multiprocessing.active_children()), flush=True)
    print("checkpoint", loader.state_dict()["step"], flush=True)
    loader.close()


if __name__ == "__main__":
    main()
"""

_SLEEP_SYSCALLS = {"x86_64": {202, 230, 35}, "aarch64": {98, 115, 101}}
"""futex (an ``Event`` wait, a semaphore), clock_nanosleep and nanosleep (``time.sleep``)."""

BOUND = 60.0
"""Seconds within which what the test waits for must happen (it happens in a few)."""


def _blocked_in_sleep(pid: int) -> bool:
    """Whether the main thread of process ``pid`` blocks in a sleep or a futex wait now."""
    try:
        fields = Path(f"/proc/{pid}/syscall").read_text().split()
    except OSError:  # gone
        return False
    calls = _SLEEP_SYSCALLS.get(platform.machine(), set())
    return bool(fields) and fields[0].isdigit() and int(fields[0]) in calls


def _gone(pid: int) -> bool:
    """Whether process ``pid`` exited (a zombie waiting for its reaper counts as exited)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat.rpartition(")")[2].split()[0] in ("Z", "X")


def _kill(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):  # exited meanwhile
        os.kill(pid, sig)


class Trainer:
    """``trainer.py`` running in a subprocess, its output lines read by a thread."""

    def __init__(self, tmp_path: Path, url: str, context: str, *options: str) -> None:
        script = tmp_path / "trainer.py"
        script.write_text(TRAINER)
        root = Path(batchweave.__file__).resolve().parents[1]  # the tree under test
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), *sys.path])}
        self.proc = subprocess.Popen(
            [sys.executable, str(script), url, context, "1", *options],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
            cwd=tmp_path,
        )
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.output: list[str] = []
        self.workers: list[int] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line.rstrip("\n"))
        self.lines.put(None)

    def wait_for(self, prefix: str) -> str:
        """The trainer's first (next) output line starting with ``prefix``."""
        deadline = time.monotonic() + BOUND
        while True:
            try:
                line = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                pytest.fail(f"no {prefix!r} line in {BOUND} s; output: {self.output}")
            if line is None:
                pytest.fail(f"the trainer ended without a {prefix!r} line: {self.output}")
            self.output.append(line)
            if line.startswith(prefix):
                return line

    def waiting_workers(self) -> list[int]:
        """The workers' pids, once each blocks in its sleep waiting for producers."""
        self.workers = [int(pid) for pid in self.wait_for("workers").split()[1:]]
        assert len(self.workers) == 2, self.output
        deadline = time.monotonic() + BOUND
        for pid in self.workers:
            while not _blocked_in_sleep(pid):
                assert time.monotonic() < deadline, f"worker {pid} never waited for producers"
                time.sleep(0.01)
        return self.workers

    def go_on(self) -> None:
        """Let a ``--retry`` trainer retry its step (it waits for a line on its stdin)."""
        assert self.proc.stdin is not None
        self.proc.stdin.write("go\n")
        self.proc.stdin.close()

    def finish(self) -> list[str]:
        """The rest of the output once the trainer exits (fails if it does not in time)."""
        try:
            self.proc.wait(BOUND)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the trainer still runs {BOUND} s later (hangs); output: {self.output}")
        while (line := self.lines.get(timeout=BOUND)) is not None:
            self.output.append(line)
        return self.output

    def kill_what_is_left(self) -> None:
        """SIGKILL the trainer and its workers if still running (a failed test): by pid."""
        for pid in self.workers:
            if not _gone(pid):
                _kill(pid, signal.SIGKILL)
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


@pytest.fixture
def unsealed(tmp_path: Path) -> str:
    """A namespace whose producers are behind: rank (1, 0) reads steps 0 and 1, then waits."""
    store = FileStore(tmp_path / "s", fsync=False)
    produce(store, "run", MESH, producers=1, tgbs=2, seal=False)
    return (tmp_path / "s").as_uri()


@pytest.fixture
def trainers(tmp_path: Path) -> Iterator[list[Trainer]]:
    started: list[Trainer] = []
    yield started
    for trainer in started:
        trainer.kill_what_is_left()


def _start(trainers: list[Trainer], tmp_path: Path, *args: str) -> Trainer:
    trainer = Trainer(tmp_path, *args)
    trainers.append(trainer)
    return trainer


def _needs_syscall_numbers() -> None:
    if platform.machine() not in _SLEEP_SYSCALLS:
        pytest.skip(f"no sleep syscall numbers known for {platform.machine()}")


def test_a_worker_killed_while_waiting_for_producers_ends_the_loop_with_torchs_error(
    tmp_path: Path, unsealed: str, trainers: list[Trainer]
) -> None:
    # Before: the loop's end hung for ever in Event.set(), waiting for the dead worker's reply.
    _needs_syscall_numbers()
    trainer = _start(trainers, tmp_path, unsealed, "fork")
    victim, _ = trainer.waiting_workers()
    os.kill(victim, signal.SIGKILL)  # the OOM killer
    output = trainer.finish()
    assert trainer.proc.returncode == 0, output
    ended = [line for line in output if line.startswith("loop ended:")]
    assert len(ended) == 1, output
    assert ended[0].startswith("loop ended: RuntimeError DataLoader worker"), output
    assert "exited unexpectedly" in ended[0]
    assert str(victim) in ended[0]
    assert output[-1] == "checkpoint 2"  # steps 0 and 1 were delivered


def test_sigterm_to_the_job_while_workers_wait_ends_the_loop_and_state_dict_works(
    tmp_path: Path, unsealed: str, trainers: list[Trainer]
) -> None:
    # Preemption (SLURM, torchrun): the whole job gets SIGTERM; the trainer catches it to
    # checkpoint, its workers die of it. Before: hung for ever in Event.set() like a SIGKILL.
    _needs_syscall_numbers()
    trainer = _start(trainers, tmp_path, unsealed, "fork", "--catch-sigterm")
    workers = trainer.waiting_workers()
    for pid in [trainer.proc.pid, *workers]:
        os.kill(pid, signal.SIGTERM)
    output = trainer.finish()
    assert trainer.proc.returncode == 0, output
    assert "SIGTERM" in output
    ended = [line for line in output if line.startswith("loop ended:")]
    assert len(ended) == 1, output
    assert ended[0].startswith("loop ended: RuntimeError DataLoader worker"), output
    assert "exited unexpectedly" in ended[0]
    assert output[-1] == "checkpoint 2"


def test_after_a_worker_died_the_same_iterator_retries_the_step_with_new_workers(
    tmp_path: Path, unsealed: str, trainers: list[Trainer]
) -> None:
    # Before: the next next() on the iterator raised StopIteration, so a retry loop ended as if
    # the stream had, although the producers went on and sealed.
    _needs_syscall_numbers()
    trainer = _start(trainers, tmp_path, unsealed, "fork", "--retry")
    victim, _ = trainer.waiting_workers()
    os.kill(victim, signal.SIGKILL)
    ended = trainer.wait_for("loop ended:")
    assert ended.startswith("loop ended: RuntimeError DataLoader worker"), trainer.output
    assert trainer.wait_for("children") == "children 0"  # the dead pool was shut down
    store = FileStore(tmp_path / "s", fsync=False)
    with Producer(store, "run", producer_id="p0", mesh=MESH, policy="naive") as producer:
        for offset in (2, 3):
            slices = [payload(0, offset, d, c, 0) for d in range(MESH.dp) for c in range(MESH.cp)]
            producer.append(slices, offset=offset)
        producer.seal()
    trainer.go_on()
    output = trainer.finish()
    assert trainer.proc.returncode == 0, output
    retried = output[output.index("children 0") + 1 :]
    assert retried == ["step 2", "step 3", "children 0", "checkpoint 4"], output


@pytest.mark.parametrize("context", ["fork", "forkserver", "spawn"])
def test_workers_waiting_for_producers_exit_when_the_training_process_dies(
    tmp_path: Path, unsealed: str, trainers: list[Trainer], context: str
) -> None:
    # Before: they waited for producers for ever, orphans holding memory and store clients.
    _needs_syscall_numbers()
    trainer = _start(trainers, tmp_path, unsealed, context)
    workers = trainer.waiting_workers()
    trainer.proc.kill()  # the OOM killer, a node agent, ...
    trainer.proc.wait()
    deadline = time.monotonic() + 30  # torch's own worker watchdog adds up to 5 s
    while not all(_gone(pid) for pid in workers):
        alive = [pid for pid in workers if not _gone(pid)]
        assert time.monotonic() < deadline, f"workers {alive} outlived the training process"
        time.sleep(0.05)


@pytest.mark.parametrize("workers", [0, 2])
def test_a_second_loader_over_the_same_dataset_starts_at_its_first_step(
    tmp_path: Path, workers: int
) -> None:
    # Before: iterating a loader wrote its resume state into the shared dataset, so a second
    # loader (say for evaluation) started where the first one was, and claimed those steps.
    store = FileStore(tmp_path / "s", fsync=False)
    produce(store, "run", MESH, producers=1, tgbs=4)
    dataset = WeaveDataset(
        (tmp_path / "s").as_uri(), "run", mesh=MESH, dp_rank=1, cp_rank=0, timeout=30
    )
    options: dict[str, Any] = {"num_workers": workers}
    if workers:
        options["multiprocessing_context"] = "fork"
    train = WeaveLoader(dataset, **options)
    for step, _ in train:
        if int(step) == 1:
            break
    for step, _ in train:  # a second loop continues: the loader resumes its workers at step 2
        assert int(step) == 2
        break
    evaluation = WeaveLoader(dataset)
    assert evaluation.state_dict()["step"] == 0
    assert [int(step) for step, _ in evaluation] == [0, 1, 2, 3]
    assert dataset.resume_state is None  # the user's dataset is left as it was
    assert [int(step) for step, _ in train] == [3]
    assert train.state_dict()["step"] == 4
    train.close()
    evaluation.close()
