"""What every command shares: store options, opening a store, one-line errors, output helpers."""

from __future__ import annotations

import errno
import json
import math
import os
import re
import shlex
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import unquote, urlsplit

import click
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from batchweave._checks import check_key_name
from batchweave._errors import (
    BatchWeaveError,
    FormatError,
    InvalidStoreURL,
    StoreError,
    StoreUnavailable,
    UnsupportedFormatVersion,
)
from batchweave._interrupts import Terminated, deferred_interrupt
from batchweave._manifest._log import _VERSION_RE, MANIFESTS_DIR
from batchweave._store._base import ObjectStore
from batchweave._store._open import SCHEMES, open_store, store_url_scheme
from batchweave._store._s3_location import S3Location

__all__ = [
    "DEBUG_ENV",
    "DEMO_DOCUMENTS",
    "MEMORY_STORE_REFUSAL",
    "NAMESPACE_META",
    "S3_OPTIONS",
    "STORE_META",
    "CliFailure",
    "FiniteFloat",
    "Terminated",
    "debug_enabled",
    "deferred_interrupt",
    "discard_stdout",
    "echo_json",
    "err_console",
    "manifest_advice",
    "namespace_named",
    "one_line",
    "open_cli_store",
    "out_console",
    "parse_duration",
    "progress_bar",
    "sigterm_as_interrupt",
    "store_options",
    "store_url",
    "tolerate_unencodable_output",
    "validate_namespace",
]

DEBUG_ENV = "BATCHWEAVE_DEBUG"
"""Set to 1 to get tracebacks instead of one-line error messages."""

F = TypeVar("F", bound=Callable[..., Any])


class CliFailure(Exception):
    """A problem the user must fix (bad argument, missing dependency): exit status 2."""


MEMORY_STORE_REFUSAL = (
    "memory:// stores exist only inside the one process that opened them, so a separate "
    "batchweave process can never see one; use a file:// directory or s3://"
)
"""Why the CLI refuses ``memory://`` URLs (each command is a process of its own)."""


DEMO_DOCUMENTS = (100, 1_000_000)
"""The fewest and most documents ``demo --documents`` accepts: a million documents (about 300
million tokens, over a GiB in memory) is more than a demo needs."""


class FiniteFloat(click.FloatRange):
    """``click.FloatRange`` that also refuses ``nan`` and ``inf`` (which pass its bounds)."""

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        number = super().convert(value, param, ctx)
        if not math.isfinite(number):
            self.fail(f"{value!r} is not a finite number", param, ctx)
        return number


_DURATION_UNITS = {"": 1.0, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


def parse_duration(ctx: click.Context, param: click.Parameter, value: str) -> float:
    """Option callback: seconds from ``90``, ``90s``, ``30m``, ``12h`` or ``7d``."""
    text = str(value).strip().lower()
    number = text.rstrip("smhd")
    try:
        seconds = float(number) * _DURATION_UNITS[text[len(number) :]]
    except (KeyError, ValueError):
        raise click.BadParameter(
            f"{value!r} is not a duration; write e.g. 90s, 30m, 12h or 7d", ctx, param
        ) from None
    if not 0 < seconds < math.inf:
        raise click.BadParameter(f"{value!r} is not a positive, finite duration", ctx, param)
    return seconds


def discard_stdout() -> None:
    """Point stdout at ``/dev/null`` after its reader went away (``| head``), so that flushing
    it at exit does not fail a second time (see the note on SIGPIPE in Python's ``signal``
    docs)."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, sys.stdout.fileno())
    finally:
        os.close(devnull)


def tolerate_unencodable_output() -> None:
    """Escape what stdout and stderr cannot encode (``\\u2713``) instead of failing on it.

    On a stream whose encoding lacks a character of a name (``PYTHONIOENCODING=latin-1``, a
    Windows console, a latin-1 locale), printing the name raised ``UnicodeEncodeError``: after
    ``seal`` or ``retire`` had committed, that turned a completed write into exit status 2
    ("could not run"). A stream that cannot be reconfigured (a replaced ``sys.stdout``, a
    closed one) is left as it is.
    """
    for stream in (sys.stdout, sys.stderr):
        reconfigure = getattr(stream, "reconfigure", None)
        if reconfigure is not None:
            with suppress(ValueError):  # closed: its first write will say so
                reconfigure(errors="backslashreplace")


class _Console(Console):
    def on_broken_pipe(self) -> None:
        # rich's default exits with status 1 ("a check failed"); let the command group handle
        # it like any other broken pipe (exit 141).
        self.quiet = True
        raise BrokenPipeError(errno.EPIPE, "stdout was closed by its reader")


def out_console() -> Console:
    """The console for results (stdout); plain text when not a terminal."""
    return _Console(highlight=False, soft_wrap=True, width=None if sys.stdout.isatty() else 120)


def err_console() -> Console:
    """The console for progress and diagnostics (stderr)."""
    return Console(stderr=True, highlight=False)


@contextmanager
def progress_bar(label: str, *, quiet: bool = False) -> Iterator[Callable[[int, int], None]]:
    """A ``progress(done, total)`` callback drawing a bar on stderr while the block runs.

    Drawn only when stderr is a terminal and not ``quiet`` (``--json``), so logs and pipes get
    nothing; the bar disappears when the block ends.
    """
    console = err_console()
    if quiet or not console.is_terminal:
        # Not even a disabled Progress: rich 13 and 14 write a newline to stderr when it stops.
        yield lambda done, total: None
        return
    with Progress(
        TextColumn(label),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
        transient=True,
    ) as progress:
        task = progress.add_task(label, total=None)
        yield lambda done, total: progress.update(task, completed=done, total=total)


def _raise_terminated(signum: int, frame: object) -> None:
    raise Terminated


@contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """While the block runs in the main thread, SIGTERM raises :class:`Terminated`.

    Python's default for SIGTERM ends the process at once: no ``finally`` runs, so ``demo``
    left its worker processes running and its work directory behind. Elsewhere than the main
    thread (signals are delivered there only) this does nothing.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def one_line(exc: BaseException) -> str:
    """``exc``'s message on one line, prefixed with its class name when that adds meaning."""
    text = " ".join(str(exc).split()) or type(exc).__name__
    if isinstance(exc, BatchWeaveError):
        return f"{type(exc).__name__}: {text}"
    return text


def store_url(location: str) -> str:
    """A store URL from ``location``: URLs pass through, a plain path becomes ``file://``.

    A mistyped URL (``file:/abs``, ``s3:bucket``) passes through too, so ``open_store`` explains
    it instead of it becoming a directory named ``file:``; a bare ``s3`` (no colon) is a
    directory of that name.
    """
    scheme, colon, _ = location.partition(":")
    if "://" in location or (colon and scheme.lower() in SCHEMES):
        return location
    if not location:
        raise InvalidStoreURL("empty store location; give a URL (s3://bucket/prefix) or a path")
    return Path(location).expanduser().resolve().as_uri()


NAMESPACE_META = "batchweave.namespace"
"""``click.Context.meta`` key: the namespace the running command was given (see
:func:`namespace_named`)."""


def validate_namespace(namespace: str) -> str:
    """Check ``namespace`` is a usable relative prefix (raises ``InvalidKey``).

    Also remembers it for the command group's error line (:func:`namespace_named`).
    """
    cleaned = namespace.strip("/")
    if not cleaned:
        raise CliFailure(f"namespace {namespace!r} is empty; name one, e.g. runs/job-42")
    check_key_name("namespace", cleaned)  # names the namespace, as the library's clients do
    ctx = click.get_current_context(silent=True)
    if ctx is not None:
        ctx.meta[NAMESPACE_META] = cleaned
    return cleaned


def namespace_named(ctx: click.Context, message: str) -> str:
    """``message`` (a ``NamespaceNotFound``'s one line) with the command's namespace quoted in
    front: the library's message shows it inside a URL, where a trailing space is invisible."""
    namespace = ctx.meta.get(NAMESPACE_META)
    if not isinstance(namespace, str):
        return message
    spaces = (
        " (it starts or ends with whitespace: check the quoting)"
        if namespace != namespace.strip()
        else ""
    )
    kind, _, rest = message.partition(": ")
    return f"{kind}: namespace {namespace!r}{spaces}: {rest}"


STORE_META = "batchweave.store"
"""``click.Context.meta`` key: the URL of the store the running command opened (set by
:func:`open_cli_store`, for :func:`manifest_advice`)."""

_MANIFEST_OBJECT = re.compile(rf"{MANIFESTS_DIR}/(?:{_VERSION_RE.pattern})")
"""A manifest version's key, as the manifest log names it."""
_ADVISED = re.compile(r"batchweave verify|backup", re.IGNORECASE)
"""Words of a message that already says what to do about a damaged object."""


def manifest_advice(ctx: click.Context, exc: BaseException, line: str) -> str:
    """``line`` (``exc``'s one line) with the next step added when ``exc`` is a damaged
    manifest version that the message leaves without one.

    A :class:`FormatError` (a :class:`ChecksumMismatch` too) naming a ``_manifests/``
    version ended at "the object is corrupt" when a command's first read of the namespace
    (``ManifestLog.latest``) met it, before any library code could add what to do. One written by
    a newer BatchWeave (:class:`UnsupportedFormatVersion`) is no damage: its message says to
    upgrade, and is left alone, as is any message that already names ``batchweave verify`` or a
    backup.
    """
    if not isinstance(exc, FormatError) or isinstance(exc, UnsupportedFormatVersion):
        return line
    if _MANIFEST_OBJECT.search(line) is None or _ADVISED.search(line) is not None:
        return line
    url, namespace = ctx.meta.get(STORE_META), ctx.meta.get(NAMESPACE_META)
    target = (
        f"{shlex.quote(url)} {shlex.quote(namespace)}"
        if isinstance(url, str) and isinstance(namespace, str)
        else "STORE NAMESPACE"
    )
    return (
        f"{line}; run `batchweave verify {target}`; restore that manifest version from a "
        "backup, or continue in a new namespace"
    )


S3_OPTIONS = ("endpoint_url", "region", "profile", "addressing_style", "probe_timeout")
"""The parameters :func:`store_options` adds: ``open_store`` options for ``s3://`` only."""


def store_options(func: F) -> F:
    """Add the S3 endpoint options every store-using command accepts."""
    # show_envvar: --help names each variable, and so does click's message for a bad value
    # (``Invalid value for '--probe-timeout' (env var: 'BATCHWEAVE_PROBE_TIMEOUT')``), which
    # otherwise blamed only a flag the user may never have typed.
    decorators = [
        click.option(
            "--endpoint-url",
            envvar="BATCHWEAVE_ENDPOINT_URL",
            show_envvar=True,
            help="S3 endpoint (MinIO, SeaweedFS, Ceph RGW).",
        ),
        click.option(
            "--region",
            envvar="BATCHWEAVE_REGION",
            show_envvar=True,
            help="S3 region (any name for self-hosted servers).",
        ),
        click.option(
            "--profile", envvar="BATCHWEAVE_PROFILE", show_envvar=True, help="AWS config profile."
        ),
        click.option(
            "--addressing-style",
            type=click.Choice(["auto", "path", "virtual"]),
            help="S3 addressing style (path for most self-hosted servers).",
        ),
        click.option(
            "--probe-timeout",
            envvar="BATCHWEAVE_PROBE_TIMEOUT",
            show_envvar=True,
            type=FiniteFloat(min=0, min_open=True),
            help="Seconds the conditional-write probe (read-only commands: a reachability "
            "check) waits for each S3 answer (default 10; larger for a slow server).",
        ),
    ]
    for decorator in reversed(decorators):
        func = decorator(func)
    return func


def open_cli_store(
    location: str, options: dict[str, Any], *, writes: bool, create: bool = False
) -> ObjectStore:
    """Open ``location`` with the S3 options that were given.

    ``writes``: the command will commit or delete, so the store is probed for enforced
    conditional writes first; read-only commands skip the probe (they may run with read-only
    credentials) and an S3 store gets a read-only reachability check instead (see
    :func:`_check_reachable`). A ``file://`` store directory must exist unless ``create`` (only
    ``demo`` makes new stores): a mistyped path is reported, not created.
    """
    url = store_url(location)
    scheme = store_url_scheme(url)  # as open_store reads it (case, leading spaces)
    if scheme == "memory":
        raise CliFailure(f"cannot use {url}: {MEMORY_STORE_REFUSAL}")
    s3 = {name: options[name] for name in S3_OPTIONS if options.get(name)}
    if scheme != "s3":
        # BATCHWEAVE_ENDPOINT_URL and friends exported for S3 work must not break a file://
        # command; only options typed on this command line are refused.
        s3 = {name: value for name, value in s3.items() if not _from_environment(name)}
    if s3 and scheme != "s3":
        verb = "applies" if len(s3) == 1 else "apply"
        names = ", ".join("--" + k.replace("_", "-") for k in s3)
        raise CliFailure(f"{names} {verb} to s3:// only")
    try:
        parts = urlsplit(url)
    except ValueError:  # malformed (s3://[::1/x): open_store says what is wrong with it
        return open_store(url, verify_conditional_writes=writes, **s3)
    # A malformed file URL (no '//', or naming a host) is left to open_store, which explains it.
    well_formed = "://" in url and parts.netloc in ("", "localhost")
    if parts.scheme.lower() == "file" and well_formed and not create:
        path = Path(unquote(parts.path, errors="surrogateescape"))  # as open_store reads it
        if not path.is_dir():
            what = "it is a file" if path.exists() else "it does not exist"
            raise CliFailure(f"no store directory at {path} ({what}); check the path")
    store = open_store(url, verify_conditional_writes=writes, **s3)
    if not writes:
        try:
            _check_reachable(store)
        except BaseException:
            store.close()
            raise
    ctx = click.get_current_context(silent=True)
    if ctx is not None:
        ctx.meta[STORE_META] = store.url  # for the error line's advice (manifest_advice)
    return store


REACHABILITY_KEY = "_batchweave/reachability-check"
"""The key a read-only command's :func:`_check_reachable` asks about (a HEAD; never written)."""


def _check_reachable(store: ObjectStore) -> None:
    """``StoreUnavailable`` if ``store`` is an S3 store whose endpoint does not answer in time.

    Read-only commands skip the conditional-write probe, whose client waits at most
    ``--probe-timeout`` for an answer; their own requests wait ``read_timeout`` (60 s) on each
    of ``max_attempts`` (5) attempts, so a port that accepts and never answers kept them
    silent for minutes. One HEAD of a key that need not exist, through the probe's client,
    fails within about ``--probe-timeout`` instead. Any answer (404, 403, even a web page)
    passes: what it means is for the command's own requests to report, with their context.
    """
    view = store._probe_view() if isinstance(store, S3Location) else None
    if view is None:
        return
    try:
        view.head(REACHABILITY_KEY)
    except StoreUnavailable:
        raise
    except StoreError:
        pass
    finally:
        view.close()


def _from_environment(name: str) -> bool:
    """Whether the current command's parameter ``name`` got its value from an env variable."""
    ctx = click.get_current_context(silent=True)
    source = ctx.get_parameter_source(name) if ctx is not None else None
    return source is click.core.ParameterSource.ENVIRONMENT


def echo_json(data: Any) -> None:
    """Print ``data`` as indented JSON on stdout."""
    click.echo(json.dumps(data, indent=2, sort_keys=False, default=str))


def debug_enabled() -> bool:
    """Whether tracebacks were asked for (``BATCHWEAVE_DEBUG=1``)."""
    return os.environ.get(DEBUG_ENV, "") not in ("", "0")
