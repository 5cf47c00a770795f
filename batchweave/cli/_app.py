"""The click application: one command per operator task (see ``docs/cli.md``).

Exit status: 0 success; 1 a check failed (``check``, ``verify``, ``demo``); 2 the command could
not run (bad URL or option, missing namespace, store unreachable, ...), reported as one line on
stderr; 130 interrupted (Ctrl-C); 141 stdout closed by its reader (``| head``); 143 terminated
(SIGTERM), after the same cleanup as Ctrl-C.
``BATCHWEAVE_DEBUG=1`` shows tracebacks instead.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path
from typing import Any

import click
from rich.markup import escape
from rich.table import Table

from batchweave._errors import BatchWeaveError, NamespaceNotFound
from batchweave._history import write_parquet
from batchweave._lifecycle import Reclaimer
from batchweave._manifest._log import ManifestLog
from batchweave._manifest._models import Manifest
from batchweave._retire import retire_producers
from batchweave._store._base import ObjectStore
from batchweave.cli._check import DEFAULT_REQUESTS, check_store, render_check
from batchweave.cli._common import (
    DEMO_DOCUMENTS,
    S3_OPTIONS,
    CliFailure,
    FiniteFloat,
    Terminated,
    debug_enabled,
    deferred_interrupt,
    discard_stdout,
    echo_json,
    manifest_advice,
    namespace_named,
    one_line,
    open_cli_store,
    out_console,
    parse_duration,
    progress_bar,
    sigterm_as_interrupt,
    store_options,
    tolerate_unencodable_output,
    validate_namespace,
)
from batchweave.cli._inspect import (
    IDLE_PRODUCER_DAYS,
    first_rows,
    gather_inspection,
    human_bytes,
    render_inspection,
    step_range,
)
from batchweave.cli._reclaim import reclaim_progress
from batchweave.cli._seal import seal_namespace
from batchweave.cli._verify import verify_namespace

__all__ = ["cli", "main"]

EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130
"""Ctrl-C: 128 + SIGINT, as shells report it; never 1, which means a check failed."""
EXIT_BROKEN_PIPE = 141
"""stdout closed by its reader (``| head``): 128 + SIGPIPE, as shells report it."""
EXIT_TERMINATED = 143
"""SIGTERM (``kill``, ``timeout``, a cancelled CI job): 128 + SIGTERM, as shells report it."""


@contextmanager
def _closed_pipe_exits_141() -> Iterator[None]:
    """A write to a stdout whose reader went away (``batchweave inspect ... | head``) ends the
    command as a shell reports SIGPIPE, quietly: it is no failure of the command."""
    try:
        yield
    except BrokenPipeError:
        if debug_enabled():
            raise
        discard_stdout()
        raise click.exceptions.Exit(EXIT_BROKEN_PIPE) from None


class _Group(click.Group):
    """Turns expected errors into one line on stderr and exit status 2, Ctrl-C into 130,
    SIGTERM into 143 (both after the cleanup an interrupted command does) and a closed stdout
    into 141."""

    def main(self, *args: Any, **kwargs: Any) -> Any:
        """Run the command line; output it cannot encode is escaped, never an error."""
        tolerate_unencodable_output()
        return super().main(*args, **kwargs)

    def make_context(
        self,
        info_name: str | None,
        args: list[str],
        parent: click.Context | None = None,
        **extra: Any,
    ) -> click.Context:
        """Parse the group's own options: ``--help`` and ``--version`` print here, before any
        command runs, so a closed stdout must exit 141 here too (click's own handler: 1)."""
        with _closed_pipe_exits_141():
            return super().make_context(info_name, args, parent, **extra)

    def invoke(self, ctx: click.Context) -> Any:
        try:
            with sigterm_as_interrupt(), _closed_pipe_exits_141():
                return super().invoke(ctx)
        except KeyboardInterrupt as exc:
            if debug_enabled():
                raise
            # Every command is safe to repeat: commits are atomic, exports appear only whole.
            if isinstance(exc, Terminated):
                click.echo(
                    "batchweave: terminated (SIGTERM); the command is safe to run again", err=True
                )
                ctx.exit(EXIT_TERMINATED)
            click.echo("batchweave: interrupted; the command is safe to run again", err=True)
            ctx.exit(EXIT_INTERRUPTED)
        except (BatchWeaveError, CliFailure, OSError, ValueError) as exc:
            if debug_enabled() or isinstance(exc, click.ClickException):
                raise
            line = manifest_advice(ctx, exc, one_line(exc))
            if isinstance(exc, NamespaceNotFound):
                line = namespace_named(ctx, line)
            click.echo(f"batchweave: error: {line}", err=True)
            ctx.exit(EXIT_USAGE)


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="batchweave")
def cli() -> None:
    """BatchWeave: a transactional training data plane on object storage.

    STORE is a URL (s3://bucket/prefix, file:///abs/path) or a local directory path.
    """


def main() -> None:
    """The ``batchweave`` console script (:func:`batchweave.cli.main`, which also turns a
    Ctrl-C during its imports into exit status 130)."""
    from batchweave.cli import main as entry_point

    entry_point()


def _open(store: str, options: dict[str, Any], *, writes: bool) -> ObjectStore:
    return open_cli_store(store, options, writes=writes)


# -- check -------------------------------------------------------------------------------------


@cli.command("check")
@click.argument("store")
@click.option(
    "--requests",
    type=click.IntRange(min=1, max=10_000),
    default=DEFAULT_REQUESTS,
    show_default=True,
    help="Timed requests per latency measurement (p50/p95).",
)
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
@store_options
def check_command(store: str, requests: int, as_json: bool, **options: Any) -> None:
    """Check that STORE can carry BatchWeave (conditional create, ranges, listing, deletes, a
    create race) and time its requests, under a scratch prefix removed afterwards.

    Exit status 0 when every required check passes, 1 when one fails, 2 when the store could
    not be checked (unreachable, or it stopped answering mid-run: the error names the scratch
    prefix left behind).
    """
    st = _open(store, options, writes=False)  # the checks probe conditional writes themselves
    try:
        with progress_bar("checking", quiet=as_json) as progress:
            report = check_store(st, requests=requests, progress=progress)
    finally:
        st.close()
    if as_json:
        echo_json(report.as_dict())
    else:
        render_check(report, out_console())
    if not report.ok:
        raise SystemExit(EXIT_FAILED)


# -- inspect ------------------------------------------------------------------------------------


@cli.command()
@click.argument("store")
@click.argument("namespace")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of tables.")
@store_options
def inspect(store: str, namespace: str, as_json: bool, **options: Any) -> None:
    """Show versions, steps, producers, watermarks, boundary and storage of NAMESPACE."""
    namespace = validate_namespace(namespace)
    st = _open(store, options, writes=False)
    data = gather_inspection(st, namespace)
    if as_json:
        echo_json(data)
    else:
        render_inspection(data, out_console())


# -- verify -------------------------------------------------------------------------------------


@cli.command()
@click.argument("store")
@click.argument("namespace")
@click.option("--footers-only", is_flag=True, help="Check footers but do not read slices.")
@click.option(
    "--workers",
    type=click.IntRange(min=1),
    default=8,
    show_default=True,
    help="Parallel object reads.",
)
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
@store_options
def verify(
    store: str, namespace: str, footers_only: bool, workers: int, as_json: bool, **options: Any
) -> None:
    """Check every referenced object, checksums, dense steps and exactly-once per producer.

    Exit status 0 when everything checks out, 1 when a problem was found, 2 when parts written
    by a newer BatchWeave could not be checked (and nothing else was wrong).
    """
    namespace = validate_namespace(namespace)
    st = _open(store, options, writes=False)
    with progress_bar("verifying", quiet=as_json) as progress:
        report = verify_namespace(
            st, namespace, read_slices=not footers_only, workers=workers, progress=progress
        )
    n_unchecked = report.steps_unchecked
    unchecked = f", {n_unchecked} could not be checked" if n_unchecked else ""
    if as_json:
        echo_json({"ok": report.ok, "complete": report.complete, **asdict(report)})
    else:
        out = out_console()
        out.print(
            f"checked {report.versions} manifest versions (latest {report.latest_version}), "
            f"steps {step_range(report.base_step, report.next_step)} ({report.steps}{unchecked}), "
            f"{report.objects} objects, {report.slices} slices, "
            f"{human_bytes(report.bytes_read)} read"
        )
        shown, rest = first_rows(sorted(report.producers.items()))
        retired = set(report.retired)
        for pid, count in shown:
            out.print(
                f"  {escape(pid)}: {count} live steps" + (" (retired id)" if pid in retired else "")
            )
        if rest:
            out.print(
                f"  ... {len(rest)} more producers: {sum(c for _, c in rest)} live steps "
                "(--json lists every producer)"
            )
        if report.steps_reclaimed:
            out.print(
                f"  {report.steps_reclaimed} steps were reclaimed during the check (a reclaim "
                "pass raised base_step); their objects were not checked"
            )
        for problem in report.problems[:100]:
            out.print(f"[red]problem[/red]: {escape(problem)}")
        if len(report.problems) > 100:
            out.print(f"... and {len(report.problems) - 100} more problems")
        for note in report.notes:
            out.print(f"note: {escape(note)}")
        for item in report.unchecked[:100]:
            out.print(f"[yellow]not checked[/yellow]: {escape(item)}")
        if len(report.unchecked) > 100:
            out.print(f"... and {len(report.unchecked) - 100} more not checked")
        also = f"; {n_unchecked} steps could not be checked" if n_unchecked else ""
        if report.problems:
            out.print(f"[red]FAILED[/red]: {len(report.problems)} problems{also}")
        elif not report.complete:
            out.print(f"[yellow]INCOMPLETE[/yellow]: no problem found{also}")
        else:
            out.print("[green]OK[/green]")
    if report.problems:
        raise SystemExit(EXIT_FAILED)
    if not report.complete:
        # Neither pass nor fail: a newer BatchWeave wrote parts this version cannot check.
        what = f"{n_unchecked} steps" if n_unchecked else "everything"
        click.echo(
            f"batchweave: error: verify could not check {what}: parts of the namespace were "
            "written by a newer BatchWeave; upgrade batchweave",
            err=True,
        )
        raise SystemExit(EXIT_USAGE)


# -- reclaim ------------------------------------------------------------------------------------


@cli.command()
@click.argument("store")
@click.argument("namespace")
@click.option(
    "--grace",
    type=FiniteFloat(min=0),
    default=600.0,
    show_default=True,
    help="Seconds an unreferenced object or superseded manifest must age before deletion.",
)
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
@click.option(
    "--progress",
    "show_progress",
    is_flag=True,
    help="Report keys listed and objects deleted on stderr as the pass goes, also with --json "
    "and off a terminal (default: a live line on a terminal, without --json).",
)
@store_options
def reclaim(
    store: str,
    namespace: str,
    grace: float,
    as_json: bool,
    show_progress: bool,
    **options: Any,
) -> None:
    """Run one reclamation pass: raise base_step to the minimum watermark and delete
    what no live checkpoint can need."""
    namespace = validate_namespace(namespace)
    st = _open(store, options, writes=True)
    ManifestLog(st, namespace).latest()  # a missing namespace is an error, not an empty pass
    with reclaim_progress(show_progress, quiet=as_json) as progress:
        report = Reclaimer(st, namespace, grace=grace, progress=progress).run_once()
    data = {**asdict(report), "objects_deleted": report.objects_deleted}
    data["bytes_deleted"] = report.bytes_deleted
    if as_json:
        echo_json(data)
        return
    table = Table(title=f"reclaim {escape(namespace)}", show_header=False, box=None)
    table.add_column(style="bold")
    table.add_column(justify="right")
    table.add_row("boundary", f"{report.boundary} ({report.watermarks} watermarks)")
    table.add_row("base step", f"{report.base_step_before} -> {report.base_step_after}")
    table.add_row("TGB objects", f"{report.tgbs_deleted} ({human_bytes(report.tgb_bytes_deleted)})")
    table.add_row(
        "orphans", f"{report.orphans_deleted} ({human_bytes(report.orphan_bytes_deleted)})"
    )
    table.add_row(
        "segments", f"{report.segments_deleted} ({human_bytes(report.segment_bytes_deleted)})"
    )
    table.add_row(
        "manifests", f"{report.manifests_deleted} ({human_bytes(report.manifest_bytes_deleted)})"
    )
    table.add_row(
        "deleted", f"{report.objects_deleted} objects, {human_bytes(report.bytes_deleted)}"
    )
    table.add_row("took", f"{report.seconds:.1f} s ({report.keys_listed} keys listed)")
    if report.damaged_versions:
        table.add_row(
            "damaged versions",
            f"{report.damaged_versions} skipped (named in the log); run `batchweave verify`",
        )
    if report.damaged_segments:
        table.add_row(
            "damaged segments",
            f"{report.damaged_segments} skipped (named in the log; their TGBs wait for the "
            "orphan rule); run `batchweave verify`",
        )
    out_console().print(table)


# -- seal ---------------------------------------------------------------------------------------


@cli.command()
@click.argument("store")
@click.argument("namespace")
@store_options
def seal(store: str, namespace: str, **options: Any) -> None:
    """Seal NAMESPACE: no more TGBs; consumers stop cleanly after the last step."""
    namespace = validate_namespace(namespace)
    st = _open(store, options, writes=True)
    manifest, sealed_now = seal_namespace(st, namespace)
    what = "sealed" if sealed_now else "was already sealed"
    click.echo(
        f"{namespace} {what} at version {manifest.version} "
        f"(steps {step_range(manifest.base_step, manifest.next_step)})"
    )


# -- retire -------------------------------------------------------------------------------------


@cli.command()
@click.argument("store")
@click.argument("namespace")
@click.option(
    "--idle-for",
    callback=parse_duration,
    default=f"{IDLE_PRODUCER_DAYS}d",
    show_default=True,
    help="Retire ids whose last commit is at least this old (90s, 30m, 12h, 7d).",
)
@click.option("--id", "ids", multiple=True, help="Only consider this producer id (repeatable).")
@click.option("--dry-run", is_flag=True, help="Show what would be retired; commit nothing.")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
@store_options
def retire(
    store: str,
    namespace: str,
    idle_for: float,
    ids: tuple[str, ...],
    dry_run: bool,
    as_json: bool,
    **options: Any,
) -> None:
    """Remove idle producer ids from NAMESPACE's manifests (their TGBs stay).

    Every id ever started stays in every manifest until retired. A process still running under
    a retired id stops with ProducerRetired; a producer started later under it begins a new
    stream with no resume offset.
    """
    namespace = validate_namespace(namespace)
    st = _open(store, options, writes=not dry_run)
    report = retire_producers(
        st, namespace, idle_for=idle_for, producer_ids=ids or None, dry_run=dry_run
    )
    if as_json:
        echo_json(asdict(report))
        return
    verb = "would retire" if dry_run else "retired"
    where = f" in version {report.version}" if report.version is not None else ""
    click.echo(
        f"{namespace}: {verb} {len(report.retired)} producer id(s){where}, "
        f"{report.remaining} remain"
    )
    for label, names in (
        (verb, report.retired),
        ("kept (active)", report.active),
        ("not listed", report.unknown),
    ):
        if names:
            click.echo(f"  {label}: {', '.join(names)}")


# -- export -------------------------------------------------------------------------------------


@cli.command()
@click.argument("store")
@click.argument("namespace")
@click.argument("destination", type=click.Path(path_type=Path))
@click.option(
    "--format",
    "fmt",
    type=click.Choice(["auto", "lance", "parquet"]),
    default="auto",
    show_default=True,
    help="auto: parquet for a .parquet destination, else a Lance dataset.",
)
@click.option("--start", type=click.IntRange(min=0), help="First step (default: base_step).")
@click.option(
    "--stop", type=click.IntRange(min=1), help="One past the last step (default: next_step)."
)
@click.option("--overwrite", is_flag=True, help="Replace an existing destination.")
@store_options
def export(
    store: str,
    namespace: str,
    destination: Path,
    fmt: str,
    start: int | None,
    stop: int | None,
    overwrite: bool,
    **options: Any,
) -> None:
    """Export batch membership history (step, dp, cp, producer, offset, bytes, sample ids)
    to a Lance dataset or a Parquet file at DESTINATION."""
    namespace = validate_namespace(namespace)
    if start is not None and stop is not None and stop <= start:
        raise CliFailure(f"--stop {stop} must be greater than --start {start}")
    _refuse_non_utf8_path(destination)
    if fmt == "auto":
        fmt = "parquet" if destination.suffix == ".parquet" else "lance"
    # --overwrite replaces a file with a file and a dataset with a dataset: refuse the wrong
    # kind now, not after reading the whole history, and before advising --overwrite, which
    # would refuse it too.
    special = _special_kind(destination)
    if special is not None:
        raise CliFailure(
            f"{destination} is {special}; export writes only a new path, a regular Parquet "
            "file or a Lance dataset directory (--overwrite replaces only those): choose "
            "another destination"
        )
    if fmt == "lance" and destination.is_dir() and not _lance_or_empty(destination):
        raise CliFailure(
            f"{destination} is a directory holding other files, not a Lance dataset; "
            "--overwrite replaces only a dataset: choose another destination"
        )
    if fmt == "parquet" and destination.is_dir():
        raise CliFailure(
            f"{destination} is a directory (a Lance dataset?); --format parquet writes a file: "
            "choose another destination or remove the directory"
        )
    if fmt == "lance" and destination.exists() and not destination.is_dir():
        raise CliFailure(
            f"{destination} is a file; a Lance dataset is a directory: choose another "
            "destination, remove the file, or pass --format parquet"
        )
    if fmt == "parquet" and destination.is_file() and not _is_parquet(destination):
        raise CliFailure(
            f"{destination} is a file but not a Parquet file (it does not start and end with "
            "PAR1); --overwrite replaces only a Parquet file: choose another destination or "
            "remove the file"
        )
    empty_dir = destination.is_dir() and not any(destination.iterdir())  # written into
    if destination.exists() and not empty_dir and not overwrite:
        raise CliFailure(f"{destination} exists; pass --overwrite to replace it")
    if not destination.parent.is_dir():
        _refuse_missing_parent(destination)
    st = _open(store, options, writes=False)
    _check_export_range(ManifestLog(st, namespace).latest(), start, stop)
    if fmt == "parquet":
        with progress_bar("exporting") as progress:
            rows = write_parquet(
                st, namespace, str(destination), start=start, stop=stop, progress=progress
            )
    else:
        try:
            from batchweave.lance import export_history
        except ImportError as exc:
            raise CliFailure(
                f"exporting to Lance needs pylance ({exc}); pip install 'batchweave[lance]' "
                "or use --format parquet"
            ) from exc
        # export_history removes what a failed or interrupted export wrote (a directory it
        # created, or the contents it put in an empty one), never a directory of the user's.
        with progress_bar("exporting") as progress, deferred_interrupt() as check:

            def step_done(done: int, total: int) -> None:
                check()  # on Lance's thread: Ctrl-C stops the write from inside
                progress(done, total)

            # "create" where nothing is replaced: Lance warns on stderr when "overwrite" finds
            # no dataset, and stderr must stay quiet (docs/cli.md).
            replace = overwrite and (destination / "_versions").is_dir()
            rows = export_history(
                st,
                namespace,
                destination,
                start=start,
                stop=stop,
                mode="overwrite" if replace else "create",
                progress=step_done,
            )
    click.echo(f"exported {rows} rows ({fmt}) to {destination}")


def _refuse_non_utf8_path(destination: Path) -> None:
    """Refuse a ``destination`` whose name is not UTF-8 (legal on Linux): the Parquet and Lance
    writers take UTF-8 paths only, and failed with a traceback or a codec message naming no
    path."""
    raw = os.fsencode(destination)
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError:
        shown = raw.decode("utf-8", errors="backslashreplace")
        raise CliFailure(
            f"{shown} is not a UTF-8 path; the Parquet and Lance writers accept only UTF-8 "
            "paths: choose another destination"
        ) from None


_PARQUET_MAGIC = b"PAR1"
"""What a Parquet file starts and ends with."""


def _is_parquet(path: Path) -> bool:
    """Whether the regular file ``path`` starts and ends with the Parquet magic."""
    with path.open("rb") as file:
        head = file.read(len(_PARQUET_MAGIC))
        size = file.seek(0, os.SEEK_END)
        if size < 2 * len(_PARQUET_MAGIC):
            return False
        file.seek(size - len(_PARQUET_MAGIC))
        return head == file.read() == _PARQUET_MAGIC


def _refuse_missing_parent(destination: Path) -> None:
    """Say why ``destination``'s directory is not one: a file in the way, or missing."""
    for ancestor in destination.parents:
        if ancestor.is_dir():
            break
        if ancestor.exists() or ancestor.is_symlink():
            raise CliFailure(
                f"{ancestor} is a file, not a directory: {destination} cannot be created under "
                "it; choose another destination"
            )
    raise CliFailure(f"directory {destination.parent} does not exist; create it first")


def _special_kind(path: Path) -> str | None:
    """What ``path`` is if it is neither absent, a regular file nor a directory: a symbolic
    link (dangling or not), a FIFO, a socket or a device; ``None`` otherwise."""
    try:
        mode = path.lstat().st_mode
    except (FileNotFoundError, NotADirectoryError):  # absent (or under a file: see below)
        return None
    if stat.S_ISLNK(mode):
        return "a symbolic link" if path.exists() else "a dangling symbolic link"
    if stat.S_ISFIFO(mode):
        return "a FIFO (named pipe)"
    if stat.S_ISSOCK(mode):
        return "a socket"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    return None


def _lance_or_empty(directory: Path) -> bool:
    """Whether ``directory`` holds a Lance dataset (its ``_versions/``) or nothing at all."""
    return (directory / "_versions").is_dir() or not any(directory.iterdir())


def _check_export_range(manifest: Manifest, start: int | None, stop: int | None) -> None:
    """Refuse ``--start``/``--stop`` asking for steps that cannot be exported: reclaimed ones
    (below ``base_step``) or none at all. ``--stop`` past ``next_step`` means "to the end"."""
    base, end = manifest.base_step, manifest.next_step
    visible = f"the namespace holds steps {base}..{end - 1}" if end > base else "no step is left"
    reclaimed = f"steps 0..{base - 1} were reclaimed" if base else "none was reclaimed"
    if start is None and stop is None:
        return  # everything, perhaps nothing: an empty history
    hint = f": pass --start {base} or later, or omit --start" if end > base else ""
    if start is not None and start < base:
        raise CliFailure(
            f"--start {start} is below base_step {base}: {visible} ({reclaimed}); their "
            f"membership is gone{hint}"
        )
    first = base if start is None else start
    last = end if stop is None else min(stop, end)
    if last <= first:
        raise CliFailure(
            f"nothing to export: --start/--stop select no committed step; {visible} ({reclaimed})"
        )


# -- demo ---------------------------------------------------------------------------------------

_AT_LEAST_1 = click.IntRange(min=1)


@cli.command()
@click.option(
    "--store",
    "store",
    default=None,
    help="Store URL or directory (default: ./weave-data/store if writable, else a temp dir).",
)
@click.option("--namespace", default=None, help="Namespace (default: demo-<random>).")
@click.option(
    "--producers", type=_AT_LEAST_1, default=3, show_default=True, help="Producer processes."
)
@click.option("--dp", type=_AT_LEAST_1, default=2, show_default=True, help="Data-parallel degree.")
@click.option(
    "--cp", type=_AT_LEAST_1, default=2, show_default=True, help="Context-parallel degree."
)
@click.option(
    "--steps", type=_AT_LEAST_1, default=360, show_default=True, help="TGBs in total (steps)."
)
@click.option(
    "--seq-len",
    type=_AT_LEAST_1,
    default=1024,
    show_default=True,
    help="Tokens per packed sequence.",
)
@click.option(
    "--micro-batch",
    type=_AT_LEAST_1,
    default=4,
    show_default=True,
    help="Sequences per DP replica.",
)
@click.option(
    "--documents",
    type=click.IntRange(min=DEMO_DOCUMENTS[0], max=DEMO_DOCUMENTS[1]),
    default=20000,
    show_default=True,
    help="Documents in the corpus.",
)
@click.option(
    "--step-time",
    type=FiniteFloat(min=0),
    default=0.1,
    show_default=True,
    help="Simulated training seconds per step.",
)
@click.option(
    "--max-lag",
    type=click.IntRange(min=0),
    default=60,
    show_default=True,
    help="Producer max_lag in steps.",
)
@click.option(
    "--checkpoint-every",
    type=_AT_LEAST_1,
    default=10,
    show_default=True,
    help="Steps per checkpoint.",
)
@click.option("--no-kill", is_flag=True, help="Do not SIGKILL a producer and a consumer halfway.")
@click.option(
    "--keep",
    is_flag=True,
    help="Keep the work directory (corpus, logs, checkpoints); the namespace always stays.",
)
@click.option(
    "--metrics-port",
    type=click.IntRange(1, 65535),
    default=None,
    help="Serve Prometheus metrics here (workers on the ports after it).",
)
@store_options
def demo(**kwargs: Any) -> None:
    """Run producers, consumers and the reclaimer end to end, kill and restart one of each,
    and verify exactly-once delivery (about a minute with the defaults)."""
    from batchweave.cli._demo import DemoConfig, run_demo

    options = {k: kwargs.pop(k) for k in S3_OPTIONS}
    config = DemoConfig(**kwargs, store_options={k: v for k, v in options.items() if v})
    ok = run_demo(config)
    if not ok:
        raise SystemExit(EXIT_FAILED)
