"""Every ```python block of ``docs/*.md`` runs, so the docs cannot drift from the code.

The blocks of one doc file form one program: the test of a block first runs the blocks above it
in the same file (in a fresh namespace, temporary directory and environment), then the block
itself, so each test stands alone and names the doc line that failed.

Snippets assume things the prose describes (a ``store``, a ``model``, a source of batches, an
S3 endpoint). An HTML comment right before a block names what the test provides for it::

    <!-- snippet: setup=s3,training_job_42 --> run these setup functions (``SETUPS``) first
    <!-- snippet: check=state_dict_keys -->    afterwards, check the result (``CHECKS``)
    <!-- snippet: skip="why" -->               do not run (keep this rare: CI runs the rest)

Two rewrites are always applied, so snippets keep the paths and endpoints a user would write:
a ``file:///abs/path`` URL moves under the test's temporary directory, and (with ``setup=s3``)
every ``"http://host:port"`` endpoint is the test's moto server.
"""

from __future__ import annotations

import ast
import re
import shlex
import textwrap
import threading
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import click
import numpy as np
import pytest

import batchweave as bw
from batchweave._metrics import MetricsServer
from batchweave.cli._app import cli
from batchweave.testing import S3Endpoint, free_port

DOCS = Path(__file__).resolve().parent.parent / "docs"

_DIRECTIVE = re.compile(r"<!--\s*snippet:(.*?)-->")
_FILE_URL = re.compile(r"file://(/[^\"'\s]*)")
_HTTP_ENDPOINT = re.compile(r"([\"'])http://[^\"']+\1")
_S3_BUCKET = re.compile(r"s3://([a-z0-9.-]+)")


@dataclass(frozen=True)
class Snippet:
    """One ```python block: where it is, its code and the directive right above it."""

    doc: str
    line: int
    code: str
    setups: tuple[str, ...] = ()
    checks: tuple[str, ...] = ()
    skip: str | None = None

    @property
    def id(self) -> str:
        return f"{self.doc}:{self.line}"


def parse_snippets(path: Path) -> list[Snippet]:
    """The ```python blocks of one markdown file, with their ``<!-- snippet: ... -->`` options."""
    lines = path.read_text().splitlines()
    snippets = []
    i = 0
    while i < len(lines):
        if lines[i].strip() != "```python":
            i += 1
            continue
        start = i + 1
        end = next(j for j in range(start, len(lines)) if lines[j].strip() == "```")
        options: dict[str, str] = {}
        before = [line for line in lines[:i] if line.strip()]
        directive = _DIRECTIVE.fullmatch(before[-1].strip()) if before else None
        if directive:
            for word in shlex.split(directive.group(1)):
                key, _, value = word.partition("=")
                options[key] = value
        unknown = set(options) - {"setup", "check", "skip"}
        assert not unknown, f"{path.name}:{start}: unknown snippet option(s) {sorted(unknown)}"
        snippets.append(
            Snippet(
                doc=path.name,
                line=start + 1,
                code=textwrap.dedent("\n".join(lines[start:end]) + "\n"),
                setups=tuple(filter(None, options.get("setup", "").split(","))),
                checks=tuple(filter(None, options.get("check", "").split(","))),
                skip=options.get("skip"),
            )
        )
        i = end + 1
    return snippets


SNIPPETS = [s for doc in sorted(DOCS.glob("*.md")) for s in parse_snippets(doc)]


def _chain(snippet: Snippet) -> list[Snippet]:
    """The blocks a test runs: those above ``snippet`` in its doc file (unless skipped), then it."""
    above = SNIPPETS[: SNIPPETS.index(snippet)]
    return [s for s in above if s.doc == snippet.doc and s.skip is None] + [snippet]


def _param(snippet: Snippet) -> Any:
    uses_s3 = any("s3" in s.setups for s in _chain(snippet))
    return pytest.param(snippet, id=snippet.id, marks=[pytest.mark.moto_server] if uses_s3 else [])


@dataclass
class Run:
    """What the snippets of one test share: their globals, the rewrites and what to close."""

    tmp: Path
    monkeypatch: pytest.MonkeyPatch
    request: pytest.FixtureRequest
    ns: dict[str, Any] = field(default_factory=dict)
    replacements: list[tuple[str, str]] = field(default_factory=list)
    value: Any = None
    """The value of a block that is a single expression (for checks)."""
    code: str = ""
    """The code of the block last run, as run."""
    endpoint: str | None = None
    """The S3 endpoint that replaces every ``"http://..."`` endpoint of a snippet."""

    def rewrite(self, code: str) -> str:
        code = _FILE_URL.sub(lambda m: f"file://{self.tmp}/fs{m.group(1)}", code)
        if self.endpoint is not None:
            code = _HTTP_ENDPOINT.sub(repr(self.endpoint), code)
        for old, new in self.replacements:
            code = code.replace(old, new)
        return code

    def execute(self, snippet: Snippet) -> None:
        for name in snippet.setups:
            SETUPS[name](self)
        code = self.code = self.rewrite(snippet.code)
        # Leading newlines make tracebacks show the line numbers of the doc file.
        source = "\n" * (snippet.line - 1) + code
        filename = str(DOCS / snippet.doc)
        try:
            expression = compile(source, filename, "eval")
        except SyntaxError:
            exec(compile(source, filename, "exec"), self.ns)
        else:
            self.value = eval(expression, self.ns)
        for name in snippet.checks:
            CHECKS[name](self)

    def close_leftovers(self) -> None:
        """Stop what the snippets left running (newest names first), as a script's exit would."""
        closable = (bw.Producer, bw.Consumer, bw.ObjectStore, MetricsServer)
        for value in reversed(list(self.ns.values())):
            if isinstance(value, bw.Reclaimer):
                value.stop()
            elif isinstance(value, closable):
                value.close()


# ------------------------------------------------------------------------------------------------
# setups: what the prose around a snippet assumes exists


def publish(
    store: bw.ObjectStore, namespace: str, mesh: bw.Mesh, steps: int, *, seal: bool = True
) -> None:
    """Commit ``steps`` tensor TGBs (``tokens`` = the offset) to ``namespace``; seal it."""
    with bw.Producer(store, namespace, producer_id="docs-setup", mesh=mesh, codec="tensors") as p:
        for offset in range(p.resume_offset, steps):
            p.append([{"tokens": np.full((2, 8), offset, np.int32)}] * mesh.slices, offset=offset)
        if seal:
            p.seal()


def s3(run: Run) -> None:
    """The session's moto server stands in for every S3 endpoint the snippet names.

    Its buckets (any ``s3://bucket`` in the doc) are created empty; credentials and endpoint
    come from the environment as a deployed job would take them.
    """
    endpoint: S3Endpoint = run.request.getfixturevalue("moto_endpoint")
    for key, value in {
        "AWS_ENDPOINT_URL": endpoint.endpoint_url,
        "AWS_ACCESS_KEY_ID": endpoint.access_key_id,
        "AWS_SECRET_ACCESS_KEY": endpoint.secret_access_key,
        "AWS_DEFAULT_REGION": endpoint.region,
    }.items():
        run.monkeypatch.setenv(key, value)
    client = endpoint.client()
    text = (DOCS / run.request.node.callspec.params["snippet"].doc).read_text()
    for bucket in sorted(set(_S3_BUCKET.findall(text))):
        endpoint.create_bucket(bucket)
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket):
            if page.get("Contents"):
                client.delete_objects(
                    Bucket=bucket, Delete={"Objects": [{"Key": o["Key"]} for o in page["Contents"]]}
                )
    client.close()
    run.endpoint = endpoint.endpoint_url


def tmp_cwd(run: Run) -> None:
    """Relative paths in the snippet (datasets, checkpoints) land in a temporary directory."""
    run.monkeypatch.chdir(run.tmp)


def training_job_42(run: Run) -> None:
    """A rank of the consumer doc's job: ``job-42`` (dp=8, cp=2) holds 3 sealed steps; the
    process is rank 5 of torchrun's 128 (tp=4, pp=2); ``checkpoint`` was taken after step 0."""
    store = bw.open_store("s3://bucket/runs")
    mesh = bw.Mesh(dp=8, cp=2)
    publish(store, "job-42", mesh, 3)
    with bw.Consumer(store, "job-42", mesh=mesh, dp_rank=0, cp_rank=0) as consumer:
        next(iter(consumer))
        state = consumer.state_dict()
    store.close()
    run.monkeypatch.setenv("RANK", "5")
    run.monkeypatch.setenv("WORLD_SIZE", "128")
    batches: list[Any] = []

    def model(batch: Any) -> float:
        batches.append(batch)
        return 0.0

    run.ns.update(
        checkpoint={"data": state}, model=model, save=lambda checkpoint: None, steps_trained=batches
    )


class _Source:
    """A source of global batches: ``iter_from(offset)`` yields ``(offset, dp*cp payloads)``."""

    def __init__(self, batches: int, slices: int) -> None:
        self.batches = batches
        self.slices = slices

    def iter_from(self, offset: int) -> Iterator[tuple[int, list[bytes]]]:
        for i in range(offset, self.batches):
            yield i, [f"batch {i} slice {s}".encode() for s in range(self.slices)]


def batch_source(run: Run) -> None:
    """``source``: a preprocessing source of 3 global batches for the snippet's mesh."""
    run.ns["source"] = _Source(3, bw.Mesh(dp=8, cp=2).slices)


def lance_corpus(run: Run) -> None:
    """``corpus.lance`` (in the working directory) and ``pack``: rows to ``dp*cp`` tensor dicts."""
    import lance
    import pyarrow as pa

    rows = 64 * 4 * 3  # three batches of 64 rows for each of the 4 shards
    lance.write_dataset(pa.table({"token": np.arange(rows, dtype=np.int32)}), "corpus.lance")
    slices = run.ns["mesh"].slices

    def pack(table: pa.Table) -> list[dict[str, np.ndarray]]:
        tokens = table.column("token").to_numpy()
        return [{"tokens": chunk} for chunk in np.array_split(tokens, slices)]

    run.ns["pack"] = pack


def producers_done(run: Run) -> None:
    """The producers of ``runs/first`` finished and sealed it, so the training loop ends."""
    publish(run.ns["store"], "runs/first", run.ns["mesh"], 0)


def train(run: Run) -> None:
    """A torch model and optimizer, ``train_step`` and a checkpoint ``path``."""
    import torch

    model = torch.nn.Linear(4, 1)
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    seen: list[Any] = []
    run.ns.update(
        model=model,
        optim=optim,
        train_step=seen.append,
        steps_trained=seen,
        path=str(run.tmp / "checkpoint.pt"),
    )


def file_store_run_1(run: Run) -> None:
    """``store`` (a ``file://`` store) and ``mesh`` (dp=2, cp=1) of namespace ``run-1``; the
    process is rank 0 of torchrun's 2."""
    run.monkeypatch.setenv("RANK", "0")
    run.monkeypatch.setenv("WORLD_SIZE", "2")
    run.ns.update(store=bw.open_store(f"file://{run.tmp}/store"), mesh=bw.Mesh(dp=2, cp=1))


class _Checkpoint:
    def __init__(self, path: Path) -> None:
        self.path = path
        self.id = path.name.removesuffix(".pt")


def checkpoint_loop(run: Run) -> None:
    """``run-1`` holds 6 sealed steps; checkpoint every 2 into ``ckpt/``, keeping the newest 2."""
    train(run)
    publish(run.ns["store"], "run-1", run.ns["mesh"], 6)
    (run.tmp / "ckpt").mkdir()

    def old_checkpoints() -> list[_Checkpoint]:
        return [_Checkpoint(p) for p in sorted((run.tmp / "ckpt").glob("*.pt"))[:-2]]

    run.ns.update(
        every=2,
        old_checkpoints=old_checkpoints,
        latest_path="ckpt/step-000006.pt",
        latest_id="step-000006",
    )


def dcp_checkpoint(run: Run) -> None:
    """Where ``torch.distributed.checkpoint`` writes, and the checkpoint's name."""
    run.ns.update(ckpt_dir=str(run.tmp / "dcp" / "step-000006"), ckpt_name="step-000006")


def monitored_job(run: Run) -> None:
    """``mesh``, a ``consumer`` and a ``reclaimer`` of ``job-42`` to track; a free metrics port."""
    store = run.ns["store"]
    mesh = bw.Mesh(dp=2, cp=1)
    run.ns.update(
        mesh=mesh,
        consumer=bw.Consumer(store, "job-42", mesh=mesh, dp_rank=0, cp_rank=0),
        reclaimer=bw.Reclaimer(store, "job-42"),
    )
    run.replacements.append(("start_metrics_server(9108)", f"start_metrics_server({free_port()})"))


SETUPS: dict[str, Callable[[Run], None]] = {
    f.__name__: f
    for f in (
        s3,
        tmp_cwd,
        training_job_42,
        batch_source,
        lance_corpus,
        producers_done,
        train,
        file_store_run_1,
        checkpoint_loop,
        dcp_checkpoint,
        monitored_job,
    )
}


# ------------------------------------------------------------------------------------------------
# checks: what a snippet shows that is not an ``assert`` in it


def state_dict_keys(run: Run) -> None:
    """The state shown is the consumer's: the same keys, the same format."""
    shown = run.value
    with bw.MemoryStore() as store:
        publish(store, "job-42", bw.Mesh(dp=8, cp=2), 1)
        with bw.Consumer(store, "job-42", mesh=bw.Mesh(dp=8, cp=2), dp_rank=3, cp_rank=1) as c:
            state = c.state_dict()
    assert list(shown) == list(state)
    assert shown["format"] == state["format"]


def trained(run: Run) -> None:
    """The training loop ran to the end of the sealed namespace and trained on its batches."""
    assert run.ns["steps_trained"]


def policy_names_shown(run: Run) -> None:
    """The policy names listed in the comment are the registered ones."""
    shown = re.search(r"policy_names\(\)\s*# (\[.*\])", run.code)
    assert shown, "the snippet lists the policy names in a comment"
    assert ast.literal_eval(shown.group(1)) == bw.policy_names()


def loader_checkpointed(run: Run) -> None:
    """The loop resumed at step 1 and ran to the end of the 3 sealed steps."""
    assert run.ns["checkpoint"]["data"]["step"] == 3


def metrics_served(run: Run) -> None:
    """The server answers with BatchWeave's metrics, including the tracked producer's."""
    url = f"http://127.0.0.1:{run.ns['metrics'].port}/metrics"
    with urllib.request.urlopen(url, timeout=10) as response:
        body = response.read().decode()
    assert 'batchweave_commits_total{namespace="job-42",producer_id="prep-3"}' in body


def store_tests_attributes(run: Run) -> None:
    """The class attributes the example scales are the conformance suite's own."""
    from batchweave.testing import StoreTests

    example = run.ns["TestMyMinio"]
    scaled = {k for k in vars(example) if not k.startswith("_") and k != "store"}
    assert scaled
    assert scaled <= set(vars(StoreTests)), scaled - set(vars(StoreTests))


def slow_puts_pass_through(run: Run) -> None:
    """The example wrapper delays a put and passes it on."""
    with run.ns["SlowPuts"](bw.MemoryStore()) as store:
        store.put("k", b"v")
        assert store.get("k") == b"v"


CHECKS: dict[str, Callable[[Run], None]] = {
    f.__name__: f
    for f in (
        state_dict_keys,
        policy_names_shown,
        trained,
        loader_checkpointed,
        metrics_served,
        store_tests_attributes,
        slow_puts_pass_through,
    )
}


# ------------------------------------------------------------------------------------------------


def test_directives_name_known_setups_and_checks() -> None:
    for s in SNIPPETS:
        assert set(s.setups) <= set(SETUPS), s.id
        assert set(s.checks) <= set(CHECKS), s.id


@pytest.mark.parametrize("snippet", [_param(s) for s in SNIPPETS])
def test_doc_snippet_runs(
    snippet: Snippet,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    request: pytest.FixtureRequest,
) -> None:
    if snippet.skip is not None:
        pytest.skip(snippet.skip)
    run = Run(tmp_path, monkeypatch, request)
    threads_before = set(threading.enumerate())
    try:
        for block in _chain(snippet):
            run.execute(block)
    finally:
        run.close_leftovers()
    assert not [t for t in threading.enumerate() if t not in threads_before and not t.daemon]


# ------------------------------------------------------------------------------------------------
# command lines: every ``batchweave <command> --option`` the docs name exists


_COMMAND = re.compile(r"\bbatchweave\s+([a-z][a-z-]*)([^`]*)")
_OPTION = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")
_CODE_SPAN = re.compile(r"`([^`]+)`")


def _options(command: click.Command) -> set[str]:
    return {o for p in command.params if isinstance(p, click.Option) for o in p.opts}


def command_lines() -> Iterator[tuple[str, str, str]]:
    """``(doc:line, command, rest)`` for every ``batchweave <command>`` in a code span (which may
    wrap) or on a line of a non-Python code block, in the docs and the README."""
    for doc in [*sorted(DOCS.glob("*.md")), DOCS.parent / "README.md"]:
        # (first line number, text): a code block's lines one by one, prose between blocks whole
        pieces: list[tuple[int, str]] = []
        prose: list[str] = []
        fence: str | None = None
        for number, line in enumerate([*doc.read_text().splitlines(), "```"], 1):
            if line.strip().startswith("```"):
                if fence is None:
                    spans = _CODE_SPAN.finditer("\n".join(prose))
                    first = number - len(prose)
                    pieces += [(first + m.string.count("\n", 0, m.start()), m[1]) for m in spans]
                    prose = []
                fence = None if fence is not None else line.strip()[3:]
            elif fence is None:
                prose.append(line)
            elif fence != "python":
                pieces.append((number, line))
        for number, text in pieces:
            for match in _COMMAND.finditer(text):
                yield f"{doc.name}:{number}", match[1], match[2]


def test_documented_command_lines_exist() -> None:
    lines = list(command_lines())
    assert {command for _, command, _ in lines} >= {"demo", "inspect", "verify", "retire"}
    for where, command, rest in lines:
        assert command in cli.commands, f"{where}: no command `batchweave {command}`"
        unknown = set(_OPTION.findall(rest)) - _options(cli.commands[command])
        assert not unknown, f"{where}: `batchweave {command}` has no option(s) {sorted(unknown)}"


def _cli_sections() -> dict[str, str]:
    """docs/cli.md split at its ``## `batchweave ...` `` headings ("" is the introduction)."""
    sections = re.split(r"^## ", (DOCS / "cli.md").read_text(), flags=re.M)
    return {"": sections[0], **{s.split("\n", 1)[0]: s for s in sections[1:]}}


def test_cli_reference_matches_the_parser() -> None:
    sections = _cli_sections()
    documented = set()
    for heading, body in sections.items():
        if not heading:
            continue
        match = re.fullmatch(r"`batchweave ([a-z-]+)(.*)`", heading)
        assert match, f"cli.md heading {heading!r} names no command"
        name, usage = match.groups()
        documented.add(name)
        command = cli.commands[name]
        # the usage line's positional arguments, in order, and the choices it lists
        arguments = [p.name.upper() for p in command.params if isinstance(p, click.Argument)]
        assert re.findall(r"(?<![\w\[-])[A-Z]{2,}(?![\w\]])", usage.split("[")[0]) == arguments
        for option, choices in re.findall(r"(--[a-z-]+) ([a-z]+(?:\|[a-z]+)+)", usage):
            param = next(p for p in command.params if option in p.opts)
            assert isinstance(param.type, click.Choice)
            assert set(choices.split("|")) == set(param.type.choices), (name, option)
        # every option the section mentions, in code spans and blocks
        mentioned = set(_OPTION.findall(" ".join(_CODE_SPAN.findall(body))))
        mentioned |= {
            o for block in re.findall(r"```.*?```", body, re.S) for o in _OPTION.findall(block)
        }
        assert mentioned <= _options(command), (name, mentioned - _options(command))
    assert documented == set(cli.commands)
    # the S3 options table of the introduction: every command but demo takes them, with these
    # environment variables
    for option, env in re.findall(r"^\| `(--[a-z-]+)` \| `?([A-Z_]*)`? \|", sections[""], re.M):
        for command in cli.commands.values():
            param = next(p for p in command.params if option in p.opts)
            assert (param.envvar or "") == env, (command.name, option)
