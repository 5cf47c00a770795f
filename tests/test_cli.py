"""Every ``batchweave`` command, run as a subprocess on a ``file://`` store."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import lance
import numpy as np
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner, Result

import batchweave as bw
import batchweave._format._tgb_write as tgb
import batchweave._history as history
import batchweave.cli._app as cli_app
import batchweave.cli._verify as cli_verify
from batchweave._history import SAMPLE_IDS_KEY, sample_ids_metadata
from batchweave._manifest import ManifestLog
from batchweave.cli._app import cli
from batchweave.cli._common import CliFailure
from batchweave.cli._demo import DemoConfig
from batchweave.cli._demo import _check as _check_demo
from batchweave.cli._inspect import MAX_TABLE_ROWS, SOURCE_SHOWN

MESH = bw.Mesh(dp=2, cp=2)
NAMESPACE = "runs/cli"


def run(*args: str, check: int | None = 0) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(
        [sys.executable, "-m", "batchweave.cli", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )
    if check is not None:
        assert proc.returncode == check, (proc.returncode, proc.stdout, proc.stderr)
    return proc


def publish(root: Path, steps: int = 12, producers: int = 2) -> bw.ObjectStore:
    store = bw.open_store(root.as_uri())
    for p in range(producers):
        with bw.Producer(
            store, NAMESPACE, producer_id=f"prep-{p}", mesh=MESH, codec="tensors"
        ) as producer:
            for offset in range(steps // producers):
                slices = [{"x": np.full(8, offset, dtype=np.int64)} for _ in range(MESH.slices)]
                ids = [[f"doc-{p}-{offset}-{i}"] for i in range(MESH.slices)]
                producer.append(
                    slices, offset=offset, metadata={SAMPLE_IDS_KEY: sample_ids_metadata(ids)}
                )
    return store


@pytest.fixture
def root(tmp_path: Path) -> Path:
    return tmp_path / "store"


def test_inspect_json_reports_steps_producers_watermarks_and_storage(root: Path) -> None:
    store = publish(root)
    bw.Watermarks(store, NAMESPACE).record("ckpt-4", step=4)
    data = json.loads(run("inspect", str(root), NAMESPACE, "--json").stdout)
    assert data["next_step"] == 12
    assert data["base_step"] == 0
    assert data["mesh"] == {"dp": 2, "cp": 2}
    assert {p["producer_id"]: p["committed_offset"] for p in data["producers"]} == {
        "prep-0": 5,
        "prep-1": 5,
    }
    assert all(p["live_steps"] == 6 for p in data["producers"])
    assert data["watermarks"][0]["checkpoint_id"] == "ckpt-4"
    assert data["boundary"] == 4
    prefixes = {row["prefix"]: row["objects"] for row in data["storage"]}
    assert prefixes["data/prep-0/"] == 6
    assert prefixes["data/prep-1/"] == 6
    assert prefixes["_watermarks/"] == 1
    assert data["latest_version"] >= 1


def test_inspect_caps_the_watermarks_table_like_the_others(root: Path) -> None:
    """The docs say tables show 30 rows; 33 watermarks printed 33 rows (and no "more" line)."""
    store = publish(root)
    marks = bw.Watermarks(store, NAMESPACE)
    count = MAX_TABLE_ROWS + 3
    for i in range(count):
        marks.record(f"ck-{i:02d}", step=1 + i % 11)
    data = json.loads(invoke("inspect", str(root), NAMESPACE, "--json").output)
    assert len(data["watermarks"]) == count  # --json lists every row
    result = invoke("inspect", str(root), NAMESPACE)
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert sum(" ck-" in line for line in lines) == MAX_TABLE_ROWS - 1
    hidden = [m["step"] for m in data["watermarks"][MAX_TABLE_ROWS - 1 :]]
    more = f"... {len(hidden)} more"
    assert any(more in line and f"{min(hidden)}..{max(hidden)}" in line for line in lines), lines
    assert " ck-00 " in result.output  # the boundary's watermark (lowest step) is shown
    assert "--json lists every row" in result.output


def test_inspect_shows_readable_watermarks_and_every_unreadable_one(root: Path) -> None:
    """Before: one unreadable watermark hid every readable one (``"watermarks": []``) and only
    the first bad key was named."""
    store = publish(root)
    marks = bw.Watermarks(store, NAMESPACE)
    for cid, step in (("a-bad", 2), ("eval-3", 3), ("train-8", 8), ("z-bad", 9)):
        marks.record(cid, step)
    bad = [marks.key("a-bad"), marks.key("z-bad")]
    for key in bad:
        store.put(key, store.get(key)[:-4])  # truncated
    data = json.loads(invoke("inspect", str(root), NAMESPACE, "--json").output)
    assert [(m["checkpoint_id"], m["step"]) for m in data["watermarks"]] == [
        ("eval-3", 3),
        ("train-8", 8),
    ]
    assert data["boundary"] is None  # unknown while any is unreadable
    assert [row["key"] for row in data["unreadable_watermarks"]] == bad
    assert all(row["error"].startswith("FormatError: ") for row in data["unreadable_watermarks"])
    assert all(repr(key) in data["watermark_error"] for key in bad)
    result = invoke("inspect", str(root), NAMESPACE)
    assert result.exit_code == 0, result.output
    text = " ".join(result.output.split())
    assert "eval-3" in text
    assert "train-8" in text
    assert "reclamation is blocked" in text
    for key in bad:
        assert f"problem: FormatError: {key}: " in text
        assert f"delete {key!r} by hand" in text


def test_inspect_tables_accept_a_file_url(root: Path) -> None:
    publish(root)
    out = run("inspect", root.as_uri(), NAMESPACE).stdout
    assert "producers" in out
    assert "prep-1" in out
    assert "storage by prefix" in out


def column_cells(table: str, first: str, column: int) -> str:
    """The text of ``column`` in the rich table row whose first cell is ``first``, unfolded."""
    cells: list[str] = []
    for line in table.splitlines():
        parts = [part.strip() for part in line.split("│")[1:-1]]
        if len(parts) <= column:
            continue
        if parts[0] == first or (cells and not parts[0]):
            cells.append(parts[column])
        elif cells:
            break
    return "".join(cells)


def test_inspect_shows_committed_source_identities(root: Path) -> None:
    store = publish(root)
    assert "source" not in run("inspect", str(root), NAMESPACE).stdout  # no column when unused
    long_source = "lance:/data/corpus.lance version=12 " + "x" * 200
    with bw.Producer(store, NAMESPACE, producer_id="prep-0", mesh=MESH, source=long_source):
        pass
    data = json.loads(run("inspect", str(root), NAMESPACE, "--json").stdout)
    assert {p["producer_id"]: p["source"] for p in data["producers"]} == {
        "prep-0": long_source,
        "prep-1": None,
    }
    table = run("inspect", str(root), NAMESPACE).stdout
    assert "source" in table
    # Folded over lines, cut to SOURCE_SHOWN characters; --json has all of it.
    assert column_cells(table, "prep-0", 6).replace(" ", "") == (
        long_source[: SOURCE_SHOWN - 3] + "..."
    ).replace(" ", "")
    assert column_cells(table, "prep-1", 6) == "-"


def test_verify_passes_then_fails_on_a_corrupt_slice(root: Path) -> None:
    publish(root)
    ok = run("verify", str(root), NAMESPACE, "--json")
    report = json.loads(ok.stdout)
    assert report["ok"] is True
    assert report["steps"] == 12
    assert report["slices"] == 12 * MESH.slices
    assert report["producers"] == {"prep-0": 6, "prep-1": 6}

    victim = sorted((root / NAMESPACE / "data" / "prep-1").rglob("*.tgb"))[0]
    raw = bytearray(victim.read_bytes())
    raw[3] ^= 0xFF  # inside the first slice's payload
    victim.write_bytes(bytes(raw))
    bad = run("verify", str(root), NAMESPACE, check=1)
    assert "FAILED" in bad.stdout
    assert "checksum" in bad.stdout.lower()
    # footers alone are intact: the footer-only mode still passes
    run("verify", str(root), NAMESPACE, "--footers-only")


def test_verify_fails_on_a_missing_object(root: Path) -> None:
    publish(root)
    victim = sorted((root / NAMESPACE / "data" / "prep-0").rglob("*.tgb"))[2]
    victim.unlink()
    bad = run("verify", str(root), NAMESPACE, "--json", check=1)
    report = json.loads(bad.stdout)
    assert report["ok"] is False
    assert any("missing" in p for p in report["problems"])


def test_reclaim_cuts_to_the_watermark_and_deletes_the_objects(root: Path) -> None:
    store = publish(root)
    bw.Watermarks(store, NAMESPACE).record("ckpt-5", step=5)
    report = json.loads(run("reclaim", str(root), NAMESPACE, "--grace", "0", "--json").stdout)
    assert report["base_step_before"] == 0
    assert report["base_step_after"] == 5
    assert report["tgbs_deleted"] == 5
    data = json.loads(run("inspect", str(root), NAMESPACE, "--json").stdout)
    assert data["base_step"] == 5
    assert sum(row["objects"] for row in data["storage"] if row["prefix"].startswith("data/")) == 7
    run("verify", str(root), NAMESPACE)


def test_seal_stops_producers_and_is_idempotent(root: Path) -> None:
    store = publish(root)
    first = run("seal", str(root), NAMESPACE).stdout
    assert "sealed at version" in first
    assert "already sealed" in run("seal", str(root), NAMESPACE).stdout
    with pytest.raises(bw.NamespaceSealed):
        bw.Producer(store, NAMESPACE, producer_id="late", mesh=MESH)
    consumer = bw.Consumer(store, NAMESPACE, mesh=MESH, dp_rank=0, cp_rank=0, timeout=5)
    assert [step for step, _ in consumer] == list(range(12))


def test_export_parquet_holds_one_row_per_slice_with_sample_ids(root: Path, tmp_path: Path) -> None:
    publish(root)
    dest = tmp_path / "history.parquet"
    out = run("export", str(root), NAMESPACE, str(dest)).stdout
    assert "exported 48 rows (parquet)" in out
    table = pq.read_table(dest)
    rows = table.to_pylist()
    assert len(rows) == 12 * MESH.slices
    assert [(r["step"], r["dp"], r["cp"]) for r in rows[:4]] == [
        (0, 0, 0),
        (0, 0, 1),
        (0, 1, 0),
        (0, 1, 1),
    ]
    first = rows[0]
    assert first["sample_ids"] == [f"doc-{first['producer_id'][-1]}-{first['offset']}-0"]
    keys = {(r["producer_id"], r["offset"]) for r in rows}
    assert keys == {(f"prep-{p}", o) for p in range(2) for o in range(6)}
    assert all(r["bytes"] > 0 and r["samples"] == 8 for r in rows)
    # an existing destination is refused without --overwrite
    refused = run("export", str(root), NAMESPACE, str(dest), check=2)
    assert "--overwrite" in refused.stderr


def test_export_lance_with_a_step_range(root: Path, tmp_path: Path) -> None:
    publish(root)
    dest = tmp_path / "history.lance"
    run("export", str(root), NAMESPACE, str(dest), "--start", "3", "--stop", "6")
    table = lance.dataset(str(dest)).to_table()
    assert table.num_rows == 3 * MESH.slices
    assert sorted(set(table.column("step").to_pylist())) == [3, 4, 5]


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (("inspect", "ftp://host/x", NAMESPACE), "unsupported scheme"),
        (("inspect", "s3://", NAMESPACE), "no bucket"),
        (("verify", "{root}", "runs/missing"), "NamespaceNotFound"),
        (("inspect", "{root}", "../escape"), "InvalidKey"),
        (("seal", "{root}", "runs/missing"), "NamespaceNotFound"),
        (("reclaim", "{root}", "runs/missing"), "NamespaceNotFound"),
        (("inspect", "{root}-nowhere", NAMESPACE), "no store directory"),
        (("inspect", "{root}", NAMESPACE, "--endpoint-url", "http://x"), "s3:// only"),
    ],
)
def test_errors_are_one_line_with_exit_status_2(
    root: Path, args: tuple[str, ...], needle: str
) -> None:
    publish(root, steps=2)
    proc = run(*(a.format(root=root) for a in args), check=2)
    assert needle in proc.stderr
    assert "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
    assert proc.stderr.startswith("batchweave: error: ")


def test_console_script_is_installed() -> None:
    proc = subprocess.run(
        [str(Path(sys.executable).with_name("batchweave")), "--help"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    for command in ("demo", "inspect", "verify", "reclaim", "seal", "export"):
        assert command in proc.stdout


def test_verify_reports_a_slice_table_that_disagrees_with_the_footer(root: Path) -> None:
    from batchweave._manifest._codec import encode_manifest
    from batchweave._manifest._log import ManifestLog, manifest_key
    from batchweave.cli._verify import verify_namespace

    store = publish(root)
    log = ManifestLog(store, NAMESPACE)
    latest = log.latest()
    ref = latest.tail[3].objects[0]
    assert ref.slices is not None
    wrong = ref.slices.model_copy(update={"checksums": (0,) * len(ref.slices.checksums)})
    tail = list(latest.tail)
    tail[3] = tail[3].model_copy(update={"objects": (ref.model_copy(update={"slices": wrong}),)})
    store.put(
        log.key(manifest_key(latest.version)),
        encode_manifest(latest.model_copy(update={"tail": tuple(tail)})),
    )
    report = verify_namespace(store, NAMESPACE, read_slices=False)
    assert len(report.problems) == 1
    assert "step 3" in report.problems[0]
    assert "slice table" in report.problems[0]


@pytest.mark.parametrize("url", ["memory://x", "MEMORY://x", " memory://x"])
@pytest.mark.parametrize(
    "command",
    [["inspect"], ["verify"], ["reclaim"], ["seal"], ["retire"], ["export", "{dest}"]],
    ids=lambda c: c[0],
)
def test_memory_store_urls_are_refused_as_one_process_only(
    command: list[str], url: str, tmp_path: Path
) -> None:
    # Before: "NamespaceNotFound: no BatchWeave namespace at memory://x/ns ...; create it by
    # opening a Producer", which no Producer in another process can ever make true. A leading
    # space (which open_store's parser strips) got past the refusal until it read the scheme
    # as open_store does.
    args = [command[0], url, "ns", *(a.format(dest=tmp_path / "h") for a in command[1:])]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 2, result.output
    text = " ".join(result.output.split())
    assert "exist only inside the one process that opened them" in text
    assert "use a file:// directory or s3://" in text
    assert "NamespaceNotFound" not in text


@pytest.mark.parametrize(
    ("variable", "value"),
    [
        ("BATCHWEAVE_ENDPOINT_URL", "http://127.0.0.1:9"),
        ("BATCHWEAVE_REGION", "us-east-1"),
        ("BATCHWEAVE_PROFILE", "audit"),
        ("BATCHWEAVE_PROBE_TIMEOUT", "5"),
    ],
)
def test_s3_settings_exported_in_the_environment_do_not_break_a_local_store(
    root: Path, variable: str, value: str
) -> None:
    # Before: exit 2 "--region apply to s3:// only" for every file:// command of a shell that
    # exported its S3 settings, although no option was typed.
    publish(root, steps=4)
    result = CliRunner().invoke(cli, ["inspect", str(root), NAMESPACE], env={variable: value})
    assert result.exit_code == 0, result.output
    assert "s3:// only" not in result.output
    option = "--" + variable.removeprefix("BATCHWEAVE_").lower().replace("_", "-")
    result = CliRunner().invoke(cli, ["inspect", str(root), NAMESPACE, option, value])
    assert result.exit_code == 2, result.output
    assert f"{option} applies to s3:// only" in result.output


@pytest.mark.parametrize("name", ["s3", "file", "memory", "S3"])
def test_a_directory_named_like_a_scheme_is_a_path(
    tmp_path: Path, name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Before: "store URL 's3' has no scheme"; only ./s3 worked.
    publish(tmp_path / name, steps=4)
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(cli, ["inspect", name, NAMESPACE, "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["next_step"] == 4


@pytest.mark.parametrize(
    ("args", "option"),
    [
        # Before: verify ran --workers 0 or -3 as 1, silently.
        (["verify", "{root}", "ns", "--workers", "0"], "--workers"),
        (["verify", "{root}", "ns", "--workers", "-3"], "--workers"),
        # Before: reclaim took --grace nan and deleted nothing, ever (every age compares false).
        (["reclaim", "{root}", "ns", "--grace", "nan"], "--grace"),
        (["reclaim", "{root}", "ns", "--grace", "-5"], "--grace"),
        (["retire", "{root}", "ns", "--idle-for", "inf"], "--idle-for"),
        (["export", "{root}", "ns", "{root}/h.parquet", "--start", "-1"], "--start"),
        (["export", "{root}", "ns", "{root}/h.parquet", "--stop", "0"], "--stop"),
        # Before: each started the demo: every producer then failed on max_lag -1, every
        # consumer on sleeping inf seconds, and port 0 put the workers' metrics on ports 1..N.
        (["demo", "--max-lag", "-1"], "--max-lag"),
        (["demo", "--metrics-port", "0"], "--metrics-port"),
        (["demo", "--step-time", "inf"], "--step-time"),
    ],
)
def test_numeric_options_outside_their_range_are_refused_by_name(
    args: list[str], option: str, tmp_path: Path
) -> None:
    result = CliRunner().invoke(cli, [a.format(root=tmp_path) for a in args])
    assert result.exit_code == 2, result.output
    assert f"Invalid value for '{option}'" in result.output


# -- batchweave.testing without the test extras --------------------------------------------------

IMPORT_WITHOUT_TEST_EXTRAS = """
import sys
sys.modules["pytest"] = None  # as if not installed
sys.modules["hypothesis"] = None
from batchweave.testing import S3Endpoint, free_port, moto_server, seaweedfs_server
try:
    from batchweave.testing import StoreTests
except ImportError as exc:
    print(exc)
else:
    print("StoreTests imported")
"""


def test_the_test_servers_import_without_pytest_and_hypothesis() -> None:
    # Before: ModuleNotFoundError for pytest, then hypothesis, which only StoreTests uses; a
    # script that wanted moto_server() for a local S3 endpoint had to install both.
    proc = subprocess.run(
        [sys.executable, "-c", IMPORT_WITHOUT_TEST_EXTRAS],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    assert "StoreTests" in proc.stdout
    assert "pip install 'batchweave[test]'" in proc.stdout


def test_the_conformance_suite_still_loads_with_pytest_assertion_rewriting() -> None:
    import batchweave.testing

    store_tests = batchweave.testing.StoreTests  # loads the suite on first use
    suite = sys.modules["batchweave.testing._store_tests"]
    assert store_tests is suite.StoreTests
    assert batchweave.testing.expected_range is suite.expected_range
    assert "@pytest_ar" in vars(suite)  # plain asserts in the suite report their values


# -- regressions: names holding rich markup, reclaim during verify/export, export edges --------


def invoke(*args: str) -> Result:
    """The CLI in this process (monkeypatches apply), output and exit status captured."""
    return CliRunner().invoke(cli, list(args), catch_exceptions=False)


def test_names_with_square_brackets_print_as_written(root: Path) -> None:
    """A namespace or producer id holding ``[`` was read as rich markup: ``reclaim`` on
    ``runs/x[/b]`` did its whole pass and then died on MarkupError (status 1, report lost),
    ``inspect`` died too, producer ``w[x]`` showed as ``w`` and ``[red]pod-7`` in red."""
    store = bw.open_store(root.as_uri())
    ns = "runs/x[/b]"
    for pid in ("w[x]", "[red]pod-7"):
        with bw.Producer(store, ns, producer_id=pid, mesh=bw.Mesh(dp=1, cp=1)) as producer:
            producer.append([b"x"], offset=0)
    bw.Watermarks(store, ns).record("ckpt-0", step=0)
    reclaimed = invoke("reclaim", str(root), ns, "--grace", "0")
    assert reclaimed.exit_code == 0, reclaimed.output
    assert f"reclaim {ns}" in reclaimed.output
    inspected = invoke("inspect", str(root), ns)
    assert inspected.exit_code == 0, inspected.output
    for name in (f"namespace {ns}", "w[x]", "[red]pod-7", "data/[red]pod-7/"):
        assert name in inspected.output
    verified = invoke("verify", str(root), ns)
    assert verified.exit_code == 0, verified.output
    assert "  w[x]: 1 live steps" in verified.output
    assert "  [red]pod-7: 1 live steps" in verified.output


def reclaim_after(module: Any, monkeypatch: pytest.MonkeyPatch, store: bw.ObjectStore, n: int):
    """Run one ordinary reclamation pass when ``module`` has read ``n`` object footers (what a
    rank's reclaimer thread or a cron ``batchweave reclaim`` may do at any time)."""
    real, calls, passes = module.read_object_footer, [0], []

    def read_object_footer(*args: Any) -> Any:
        calls[0] += 1
        if calls[0] == n:
            passes.append(bw.Reclaimer(store, NAMESPACE, grace=600).run_once())
        return real(*args)

    monkeypatch.setattr(module, "read_object_footer", read_object_footer)
    return passes


def test_verify_skips_steps_reclaimed_while_it_runs(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A healthy namespace failed ``verify`` (status 1, "the step is lost") when a routine
    reclamation deleted the TGBs of steps it had not read yet."""
    store = publish(root)
    bw.Watermarks(store, NAMESPACE).record("ckpt-8", step=8)
    passes = reclaim_after(cli_verify, monkeypatch, store, 3)
    result = invoke("verify", str(root), NAMESPACE, "--workers", "1", "--json")
    assert passes[0].tgbs_deleted == 8
    report = json.loads(result.output)
    assert report["problems"] == []
    assert result.exit_code == 0
    # Steps 0 and 1 were checked before the pass; the objects of steps 2..7 were gone when
    # read. Before, all 8 counted as reclaimed and as checked (``steps``) too.
    assert report["steps_reclaimed"] == 6
    assert report["steps"] + report["steps_reclaimed"] == report["next_step"] - report["base_step"]
    # a missing object of a step that stays live is still a loss
    monkeypatch.undo()
    sorted((root / NAMESPACE / "data" / "prep-1").rglob("*.tgb"))[-1].unlink()
    assert invoke("verify", str(root), NAMESPACE).exit_code == 1


def test_export_says_when_steps_were_reclaimed_while_it_ran(
    root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``export`` failed with a bare ObjectNotFound when a reclamation pass ran meanwhile."""
    store = publish(root)
    bw.Watermarks(store, NAMESPACE).record("ckpt-8", step=8)
    reclaim_after(history, monkeypatch, store, 3)
    dest = tmp_path / "history.parquet"
    result = invoke("export", str(root), NAMESPACE, str(dest))
    assert result.exit_code == 2
    assert "StepReclaimed: steps 2..7 were reclaimed while the history was being read" in (
        result.output
    )
    assert "now start at 8" in result.output
    assert not dest.exists()
    monkeypatch.undo()
    again = invoke("export", str(root), NAMESPACE, str(dest))
    assert "exported 16 rows" in again.output


def test_verify_finds_sample_ids_that_export_refuses(
    root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Sample ids with the wrong number of entries passed ``verify`` and then failed ``export``
    with a FormatError whose advice is "run verify". The encoder now refuses them; an object
    written without that check (an older BatchWeave) is still found."""
    monkeypatch.setattr(tgb, "_check_sample_ids", lambda metadata, mesh: None)
    store = bw.open_store(root.as_uri())
    with bw.Producer(store, NAMESPACE, producer_id="p0", mesh=MESH) as producer:
        producer.append(
            [b"x"] * MESH.slices,
            offset=0,
            metadata={SAMPLE_IDS_KEY: sample_ids_metadata([["a"], ["b"]])},
        )
    result = invoke("verify", str(root), NAMESPACE, "--footers-only", "--json")
    assert result.exit_code == 1
    [problem] = json.loads(result.output)["problems"]
    assert f"must list one entry per slice ({MESH.slices})" in problem
    assert problem.startswith("step 0 (p0 offset 0): ")
    assert invoke("export", str(root), NAMESPACE, str(tmp_path / "h.parquet")).exit_code == 2


@pytest.mark.parametrize(
    ("window", "needle"),
    [
        (("--start", "0", "--stop", "3"), "--start 0 is below base_step 3"),
        (("--start", "1"), "--start 1 is below base_step 3"),
        (("--stop", "3"), "nothing to export"),
        (("--start", "12"), "nothing to export"),
        (("--start", "20", "--stop", "30"), "nothing to export"),
    ],
)
def test_export_refuses_steps_it_cannot_export(
    root: Path, tmp_path: Path, window: tuple[str, ...], needle: str
) -> None:
    """A window outside ``base_step .. next_step - 1`` wrote 0 rows and exited 0."""
    store = publish(root)
    bw.Watermarks(store, NAMESPACE).record("ckpt-3", step=3)
    bw.Reclaimer(store, NAMESPACE, grace=0).run_once()
    dest = tmp_path / "history.parquet"
    result = invoke("export", str(root), NAMESPACE, str(dest), *window)
    assert result.exit_code == 2
    assert needle in result.output
    assert "the namespace holds steps 3..11 (steps 0..2 were reclaimed)" in result.output
    assert not dest.exists()
    # --stop past next_step means "to the end"
    to_the_end = invoke("export", str(root), NAMESPACE, str(dest), "--start", "3", "--stop", "99")
    assert "exported 36 rows" in to_the_end.output


@pytest.mark.parametrize(
    ("name", "fmt", "needle"),
    [
        ("history.lance", "parquet", "is a directory (a Lance dataset?)"),
        ("history.parquet", "lance", "is a file; a Lance dataset is a directory"),
        ("history.parquet", "auto", "is a directory (a Lance dataset?)"),
    ],
)
def test_export_overwrite_refuses_the_wrong_kind_before_reading(
    root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str, fmt: str, needle: str
) -> None:
    """Parquet onto a Lance directory failed at the rename after the whole export (Errno 21);
    Lance onto a Parquet file failed with a raw LanceError."""
    dest = tmp_path / name
    if fmt == "lance":
        dest.write_bytes(b"PAR1")
    else:
        dest.mkdir()

    def no_store(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("the store was opened")

    monkeypatch.setattr(cli_app, "_open", no_store)
    result = invoke("export", str(root), NAMESPACE, str(dest), "--format", fmt, "--overwrite")
    assert result.exit_code == 2
    assert needle in result.output


@pytest.mark.parametrize("kind", ["symlink", "fifo", "foreign directory"])
def test_export_overwrite_replaces_only_a_parquet_file_or_a_lance_dataset(
    root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    """--overwrite replaced a symlink, a FIFO (or /dev/stdout, as root) with a regular file, and
    turned a directory of other files into a Lance dataset."""
    target = tmp_path / "real.parquet"
    target.write_bytes(b"PAR1 the user's own file")
    if kind == "symlink":
        dest, needle = tmp_path / "link.parquet", "is a symbolic link;"
        dest.symlink_to(target)
    elif kind == "fifo":
        dest, needle = tmp_path / "pipe.parquet", "is a FIFO (named pipe);"
        os.mkfifo(dest)
    else:
        dest, needle = tmp_path / "notes", "is a directory holding other files"
        dest.mkdir()
        (dest / "notes.txt").write_text("mine")

    def no_store(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("the store was opened")

    monkeypatch.setattr(cli_app, "_open", no_store)
    result = invoke("export", str(root), NAMESPACE, str(dest), "--overwrite")
    assert result.exit_code == 2
    assert needle in result.output
    assert target.read_bytes() == b"PAR1 the user's own file"
    assert dest.is_symlink() or not dest.is_file()  # nothing was put in its place


@pytest.mark.parametrize("flags", [[], ["--overwrite"]])
def test_export_into_an_empty_directory_writes_a_dataset(
    root: Path, tmp_path: Path, flags: list[str]
) -> None:
    """Before: without ``--overwrite`` an empty directory got "exists; pass --overwrite",
    which docs/cli.md gives only a Parquet file or a dataset (and export_history writes it)."""
    publish(root)
    dest = tmp_path / "empty"
    dest.mkdir()
    run("export", str(root), NAMESPACE, str(dest), *flags)
    assert lance.dataset(str(dest)).count_rows() > 0


def test_export_overwrite_of_a_new_path_writes_nothing_to_stderr(
    root: Path, tmp_path: Path
) -> None:
    """Before: with --overwrite and no dataset yet, Lance's own logger wrote "WARN ... No
    existing dataset ... it will be created" to stderr, which docs/cli.md keeps quiet."""
    publish(root)
    dest = tmp_path / "new.lance"
    cmd = [sys.executable, "-m", "batchweave", "export", str(root), NAMESPACE, str(dest)]
    done = subprocess.run([*cmd, "--overwrite"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""
    assert lance.dataset(str(dest)).count_rows() > 0


@pytest.mark.parametrize("flags", [[], ["--overwrite"]])
def test_a_failed_export_into_an_empty_directory_keeps_the_directory(
    root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, flags: list[str]
) -> None:
    """The CLI removed the user's own (empty) directory when the export failed."""
    store = publish(root)
    bw.Watermarks(store, NAMESPACE).record("ckpt-8", step=8)
    reclaim_after(history, monkeypatch, store, 3)  # the export fails part way
    dest = tmp_path / "empty"
    dest.mkdir()
    result = invoke("export", str(root), NAMESPACE, str(dest), *flags)
    assert result.exit_code == 2
    assert dest.is_dir()
    assert list(dest.iterdir()) == []  # what the export wrote is gone, the directory is not


@pytest.mark.parametrize(("port", "ok"), [(65528, True), (65529, False), (65535, False)])
def test_demo_metrics_ports_must_fit_below_65536(port: int, ok: bool) -> None:
    """``--metrics-port 65535`` passed: the workers' ports after it do not exist."""
    config = DemoConfig(metrics_port=port)  # 3 producers, 4 ranks: ports port+1..port+7
    if ok:
        _check_demo(config)
    else:
        with pytest.raises(CliFailure, match=r"past 65535; pick a port at most 65528"):
            _check_demo(config)


# -- what a command says about its own arguments -------------------------------------------------


@pytest.mark.parametrize("kind", ["symlink", "dangling symlink", "fifo", "foreign directory"])
def test_export_refuses_what_overwrite_would_refuse_without_advising_overwrite(
    root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    """Before: "X exists; pass --overwrite to replace it", then --overwrite refused X."""
    target = tmp_path / "real.parquet"
    target.write_bytes(b"PAR1")
    needles = {
        "symlink": ("link.parquet", "is a symbolic link;"),
        "dangling symlink": ("dangling.parquet", "is a dangling symbolic link;"),
        "fifo": ("pipe.parquet", "is a FIFO (named pipe);"),
        "foreign directory": ("notes", "is a directory holding other files, not a Lance dataset"),
    }
    name, needle = needles[kind]
    dest = tmp_path / name
    if kind == "symlink":
        dest.symlink_to(target)
    elif kind == "dangling symlink":
        dest.symlink_to(tmp_path / "nowhere.parquet")
    elif kind == "fifo":
        os.mkfifo(dest)
    else:
        dest.mkdir()
        (dest / "notes.txt").write_text("mine")

    def no_store(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("the store was opened")

    monkeypatch.setattr(cli_app, "_open", no_store)
    for extra in ([], ["--overwrite"]):
        result = invoke("export", str(root), NAMESPACE, str(dest), *extra)
        assert result.exit_code == 2, result.output
        assert needle in result.output
        assert "pass --overwrite" not in result.output
        assert "choose another destination" in result.output


def test_export_under_a_regular_file_says_it_is_a_file(root: Path, tmp_path: Path) -> None:
    """Before: "directory afile does not exist; create it first" (it exists, as a file)."""
    (tmp_path / "afile").write_text("")
    for dest in (tmp_path / "afile" / "x.parquet", tmp_path / "afile" / "sub" / "x.parquet"):
        result = invoke("export", str(root), NAMESPACE, str(dest))
        assert result.exit_code == 2
        text = " ".join(result.output.split())
        assert f"{tmp_path / 'afile'} is a file, not a directory" in text
        assert "does not exist" not in text
    missing = invoke("export", str(root), NAMESPACE, str(tmp_path / "nodir" / "x.parquet"))
    assert f"directory {tmp_path / 'nodir'} does not exist; create it first" in missing.output


def test_a_missing_namespace_is_shown_quoted(root: Path) -> None:
    """Before: the namespace appeared only inside the URL, where a trailing space is invisible."""
    publish(root, steps=2)
    proc = run("inspect", str(root), f"{NAMESPACE} ", check=2)
    line = proc.stderr.strip()
    assert line.startswith(f"batchweave: error: NamespaceNotFound: namespace '{NAMESPACE} '")
    assert "starts or ends with whitespace" in line
    plain = run("verify", str(root), "runs/other", check=2).stderr
    assert plain.startswith("batchweave: error: NamespaceNotFound: namespace 'runs/other': no ")
    assert "whitespace" not in plain


def test_a_bad_value_from_the_environment_names_the_variable(root: Path) -> None:
    """Before: "Invalid value for '--probe-timeout'", a flag the user never passed."""
    result = CliRunner().invoke(
        cli, ["inspect", str(root), NAMESPACE], env={"BATCHWEAVE_PROBE_TIMEOUT": "abc"}
    )
    assert result.exit_code == 2
    assert "BATCHWEAVE_PROBE_TIMEOUT" in result.output
    assert "'--probe-timeout'" in result.output


def test_help_names_every_s3_environment_variable() -> None:
    text = " ".join(CliRunner().invoke(cli, ["inspect", "--help"]).output.split())
    for option, variable in (
        ("--endpoint-url", "BATCHWEAVE_ENDPOINT_URL"),
        ("--region", "BATCHWEAVE_REGION"),
        ("--profile", "BATCHWEAVE_PROFILE"),
        ("--probe-timeout", "BATCHWEAVE_PROBE_TIMEOUT"),
    ):
        after = text.split(option, 1)[1].split(" --", 1)[0]
        assert variable in after, (option, after)


def test_python_dash_m_batchweave_runs_the_cli() -> None:
    """Before: "No module named batchweave.__main__"."""
    proc = subprocess.run(
        [sys.executable, "-m", "batchweave", "--help"], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("Usage: batchweave ")
    for command in ("check", "demo", "inspect", "verify", "reclaim", "seal", "export"):
        assert command in proc.stdout


@pytest.mark.parametrize("content", [b"my precious notes\n", b"", b"PAR1 only at the start"])
def test_export_parquet_refuses_a_file_that_is_not_parquet(
    root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, content: bytes
) -> None:
    """Before: "notes.txt exists; pass --overwrite", and --overwrite replaced the user's text
    file with Parquet (the docs say --overwrite replaces only a Parquet file)."""
    dest = tmp_path / "notes.txt"
    dest.write_bytes(content)

    def no_store(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("the store was opened")

    monkeypatch.setattr(cli_app, "_open", no_store)
    for extra in ([], ["--overwrite"]):
        result = invoke("export", str(root), NAMESPACE, str(dest), "--format", "parquet", *extra)
        assert result.exit_code == 2, result.output
        text = " ".join(result.output.split())
        assert f"{dest} is a file but not a Parquet file" in text
        assert "pass --overwrite" not in text
        assert dest.read_bytes() == content


def test_export_parquet_overwrite_still_replaces_a_parquet_file(root: Path, tmp_path: Path) -> None:
    publish(root)
    dest = tmp_path / "history.parquet"
    run("export", str(root), NAMESPACE, str(dest))
    refused = run("export", str(root), NAMESPACE, str(dest), check=2)
    assert "exists; pass --overwrite to replace it" in refused.stderr
    run("export", str(root), NAMESPACE, str(dest), "--overwrite")
    assert pq.read_table(dest).num_rows == 48  # 12 steps of 4 slices


@pytest.mark.parametrize("name", ["h.parquet", "h.lance"])
def test_export_refuses_a_destination_that_is_not_utf8_naming_it(
    root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    """Before: Lance failed with a TypeError traceback (exit 1), Parquet with a codec message
    naming no path (after reading the whole history)."""
    outdir = os.fsdecode(os.path.join(os.fsencode(tmp_path), b"out\xff"))
    os.mkdir(outdir)

    def no_store(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("the store was opened")

    monkeypatch.setattr(cli_app, "_open", no_store)
    result = invoke("export", str(root), NAMESPACE, os.path.join(outdir, name))
    assert result.exit_code == 2, result.output
    text = " ".join(result.output.split())
    assert f"{tmp_path}/out\\xff/{name} is not a UTF-8 path" in text
    assert "choose another destination" in text


def test_names_a_stdout_cannot_encode_are_escaped_not_an_error(root: Path) -> None:
    """With a latin-1 stdout, ``seal`` and ``retire`` committed and then exited 2 ("could not
    run") on UnicodeEncodeError printing the name; ``verify`` and ``inspect`` exited 2 too."""
    store = bw.open_store(root.as_uri())
    ns = "runs/job-\u2713"
    with bw.Producer(store, ns, producer_id="prep-\u2713", mesh=bw.Mesh(dp=1, cp=1)) as producer:
        producer.append([b"x" * 10], offset=0)
    env = dict(os.environ, PYTHONIOENCODING="latin-1")
    for args in (
        ("verify", str(root), ns),
        ("inspect", str(root), ns),
        ("reclaim", str(root), ns, "--grace", "0"),
        ("seal", str(root), ns),
        ("retire", str(root), ns, "--idle-for", "1s"),
    ):
        proc = subprocess.run(
            [sys.executable, "-m", "batchweave.cli", *args],
            capture_output=True,
            env=env,
            timeout=120,
        )
        assert proc.returncode == 0, (args, proc.stderr)
        assert b"\\u2713" in proc.stdout, (args, proc.stdout)  # a name, escaped
    latest = ManifestLog(store, ns).latest()
    assert latest.sealed
    assert list(latest.producers) == []
