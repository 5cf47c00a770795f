"""``batchweave verify`` on damaged namespaces and on data written by a newer BatchWeave.

Pinned here: a damaged or missing segment is one problem naming its key and steps, and the other
segments and the tail are still checked (it hid all other damage, "0 objects"); the summary
counts the steps that could not be checked. A newest manifest version in a newer format exits 2
("upgrade batchweave") instead of calling the namespace damaged; a segment or TGB in a newer
format is "not checked" (upgrade), never damage with restore advice. An object longer than the
manifest records (bytes appended) is a problem: it passed, though the format's own reader
refuses it. An offset committed twice within one stream of a producer is a problem, also when
old manifest versions were reclaimed, as long as the epochs show it is one stream. verify holds
a bounded number of descriptors however long the history (it held all of them: gigabytes).
"""

from __future__ import annotations

import gc
import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from manifest_helpers import body, envelope

import batchweave as bw
from batchweave._format._checksum import checksum
from batchweave._format._tgb import TRAILER_SIZE, TRAILER_STRUCT
from batchweave._format._tgb_read import _ALGO_BY_ID, FORMAT_VERSION
from batchweave._history import read_object_footer
from batchweave._manifest import Committed, ManifestLog, encode_manifest, manifest_key
from batchweave._manifest._codec import body_checksum, forget_decoded
from batchweave._manifest._models import Manifest, SegmentRef, TgbDescriptor, TgbObjectRef
from batchweave._manifest._segments import SegmentFiles
from batchweave._store._memory import MemoryStore
from batchweave.cli._verify import VerifyReport, verify_namespace

NS = "ns"
STEPS = 12


@pytest.fixture(scope="module")
def template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """12 steps of one producer, laid out as segments for steps 0..4 and 5..8 and a tail of
    steps 9..11 (whatever merges the producer did)."""
    root = tmp_path_factory.mktemp("template") / "store"
    root.mkdir()
    store = bw.open_store(root.as_uri())
    with bw.Producer(store, NS, mesh=bw.Mesh(dp=2, cp=1), producer_id="p", codec="raw") as p:
        for i in range(STEPS):
            p.append([b"a%03d" % i * 50, b"b%03d" % i * 50], offset=i)
    log = ManifestLog(store, NS)
    latest = log.latest()
    tgbs = [desc for _, desc in log.descriptors(latest, 0, STEPS)]
    segments = SegmentFiles(store, log.key, cache=0)
    refs = (
        segments.write(latest.namespace_id, 0, tgbs[:5]),
        segments.write(latest.namespace_id, 5, tgbs[5:9]),
    )
    commit_next(store, log, latest, segments=refs, tail=tuple(tgbs[9:]), tail_start=9)
    return root


@pytest.fixture
def root(template: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "store"
    shutil.copytree(template, copy)
    return copy


def open_log(root: Path) -> tuple[bw.ObjectStore, ManifestLog, Manifest]:
    store = bw.open_store(root.as_uri())
    log = ManifestLog(store, NS)
    return store, log, log.latest()


def verify(root: Path) -> VerifyReport:
    return verify_namespace(bw.open_store(root.as_uri()), NS)


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "batchweave.cli", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )


def tgb_path(root: Path, step: int) -> Path:
    _, log, latest = open_log(root)
    return root / NS / log.descriptor(latest, step).objects[0].key


def flip_last_bytes(path: Path) -> None:
    raw = bytearray(path.read_bytes())
    raw[-5] ^= 1
    path.write_bytes(bytes(raw))


def commit_next(store: bw.ObjectStore, log: ManifestLog, manifest: Manifest, **update: Any) -> None:
    """Commit a copy of ``manifest`` with ``update`` as the next version (a hand-made writer)."""
    version = manifest.version + 1
    new = manifest.model_copy(
        update={"version": version, "parent": manifest.version, "commit_id": "e" * 32, **update}
    )
    store.put_if_absent(log.key(manifest_key(version)), encode_manifest(new))


# -- 1: a damaged or missing segment hides nothing else ----------------------------------------


def test_a_damaged_segment_is_one_problem_and_the_rest_is_still_checked(root: Path) -> None:
    """It printed "0 objects", "steps checked 0" and the segment only: the step-11 object
    deleted as well went unreported."""
    _, log, latest = open_log(root)
    first = latest.segments[0]
    assert (first.first_step, first.count, latest.tail_start) == (0, 5, 9)
    flip_last_bytes(root / NS / first.key)
    lost = tgb_path(root, 11)  # in the tail
    lost.unlink()

    report = verify(root)
    assert len(report.problems) == 2, report.problems
    segment, missing = report.problems
    assert log.key(first.key) in segment
    assert "steps 0..4" in segment
    assert "damaged" in segment
    assert "restore the segment object" in segment
    assert lost.name in missing
    assert "step 11" in missing
    assert report.steps == 7  # steps 5..11: the second segment and the tail
    assert report.steps_unchecked == 5
    assert report.objects == 6  # 7 steps, one object missing
    assert not any("dense" in p or "steps end" in p for p in report.problems)
    assert not report.ok
    assert not report.complete


def test_a_missing_segment_in_the_middle_names_its_steps(root: Path) -> None:
    _, log, latest = open_log(root)
    second = latest.segments[1]
    (root / NS / second.key).unlink()
    flip_last_bytes(tgb_path(root, 0))  # damage in segment 1's steps is still found

    report = verify(root)
    assert report.steps == STEPS - second.count
    assert report.steps_unchecked == second.count
    text = " ".join(report.problems)
    assert log.key(second.key) in text
    assert "is missing" in text
    assert f"steps {second.first_step}..{second.end_step - 1}" in text
    assert "step 0 " in text
    assert not any("dense" in p or "steps end" in p for p in report.problems)


def test_the_json_report_counts_the_steps_not_checked(root: Path) -> None:
    _, _, latest = open_log(root)
    flip_last_bytes(root / NS / latest.segments[0].key)
    tgb_path(root, 11).unlink()
    result = run("verify", "--json", str(root), NS)
    assert result.returncode == 1, result.stderr
    report = json.loads(result.stdout)
    assert report["ok"] is False
    assert (report["steps"], report["steps_unchecked"], report["objects"]) == (7, 5, 6)
    assert any("step 11" in p for p in report["problems"])


def test_a_damaged_newest_manifest_leaves_the_check_incomplete(root: Path) -> None:
    """It reported "complete": true (everything checked) with 0 steps checked: the live steps of
    the unreadable version count as not checked, by the newest readable version's count."""
    _, log, latest = open_log(root)
    flip_last_bytes(root / log.key(manifest_key(latest.version)))
    result = run("verify", "--json", str(root), NS)
    assert result.returncode == 1, result.stderr
    data = json.loads(result.stdout)
    assert (data["ok"], data["complete"], data["steps"]) == (False, False, 0)
    assert data["steps_unchecked"] == STEPS  # version latest - 1 lists every step too
    assert "the newest manifest version cannot be read" in data["problems"][0]
    [unchecked] = data["unchecked"]
    assert f"manifest version {latest.version} " in unchecked
    assert f"version, {latest.version - 1}, lists steps 0..{STEPS - 1}" in unchecked


def test_a_damaged_only_manifest_leaves_the_check_incomplete(root: Path) -> None:
    """No older version to count its steps by: still not complete, the count said unknown."""
    _, log, latest = open_log(root)
    newest = root / log.key(manifest_key(latest.version))
    for path in newest.parent.iterdir():
        if path != newest:
            path.unlink()
    flip_last_bytes(newest)
    report = verify(root)
    assert (report.ok, report.complete, report.steps, report.steps_unchecked) == (
        False,
        False,
        0,
        0,
    )
    assert len(report.problems) == 1
    [unchecked] = report.unchecked
    assert "unknown" in unchecked


# -- 2: a newer BatchWeave's data is no damage -------------------------------------------------


def test_a_newest_manifest_of_a_newer_format_cannot_be_checked(root: Path) -> None:
    """Exit 1 and "Restore the object from a backup, or resume in a new namespace" for a
    namespace a newer BatchWeave committed to: an upgrade is all it needs."""
    mdir = root / NS / "_manifests"
    newest = sorted(mdir.iterdir())[-1]
    doc = json.loads(body(newest.read_bytes()))
    doc.update(format=5, version=doc["version"] + 1, parent=doc["version"], commit_id="f" * 32)
    raw = json.dumps(doc, separators=(",", ":")).encode()
    (mdir / manifest_key(doc["version"]).split("/")[-1]).write_bytes(envelope(raw))

    with pytest.raises(bw.UnsupportedFormatVersion, match="upgrade batchweave"):
        verify(root)
    result = run("verify", str(root), NS)
    assert result.returncode == 2, (result.stdout, result.stderr)
    assert "UnsupportedFormatVersion" in result.stderr
    assert "upgrade batchweave" in result.stderr
    assert "restore" not in (result.stdout + result.stderr).lower()


def test_a_segment_of_a_newer_format_is_not_checked_and_no_damage(root: Path) -> None:
    store, log, latest = open_log(root)
    ref = latest.segments[0]
    seg = json.loads(body(store.get(log.key(ref.key))))
    seg["format"] = 4
    raw = envelope(json.dumps(seg, separators=(",", ":")).encode(), "batchweave-segment")
    newer = ref.key.replace(".seg", "-v4.seg")
    store.put(log.key(newer), raw)
    newer_ref = SegmentRef(
        key=newer,
        first_step=ref.first_step,
        count=ref.count,
        bytes=len(raw),
        checksum=body_checksum(body(raw)),
    )
    commit_next(store, log, latest, segments=(newer_ref, *latest.segments[1:]))

    report = verify(root)
    assert report.problems == []
    assert len(report.unchecked) == 1
    assert "written by a newer BatchWeave" in report.unchecked[0]
    assert "upgrade batchweave" in report.unchecked[0]
    assert "steps 0..4" in report.unchecked[0]
    assert newer in report.unchecked[0]
    assert (report.steps, report.steps_unchecked) == (7, 5)
    assert not report.ok
    assert not report.complete


def bump_trailer_version(path: Path) -> None:
    """Rewrite ``path``'s trailer as a newer BatchWeave would: format ``FORMAT_VERSION + 1``,
    with a valid footer checksum (the footer bytes, which the manifest checksums, unchanged)."""
    raw = bytearray(path.read_bytes())
    length, _, algo_id, reserved, _, magic = TRAILER_STRUCT.unpack(raw[-TRAILER_SIZE:])
    footer = bytes(raw[-TRAILER_SIZE - length : -TRAILER_SIZE])
    version = FORMAT_VERSION + 1
    head = TRAILER_STRUCT.pack(length, version, algo_id, reserved, 0, magic)[:16]
    crc = checksum(footer + head, _ALGO_BY_ID[algo_id])
    raw[-TRAILER_SIZE:] = TRAILER_STRUCT.pack(length, version, algo_id, reserved, crc, magic)
    path.write_bytes(bytes(raw))


def test_a_tgb_of_a_newer_format_is_not_checked_and_no_damage(root: Path) -> None:
    victim = tgb_path(root, 6)
    bump_trailer_version(victim)

    report = verify(root)
    assert report.problems == []
    assert len(report.unchecked) == 1
    item = report.unchecked[0]
    assert "step 6 " in item
    assert victim.name in item
    assert "written by a newer BatchWeave" in item
    assert "upgrade batchweave" in item
    assert (report.steps, report.steps_unchecked) == (STEPS - 1, 1)
    assert not report.ok
    assert not report.complete


# -- 3: an object's real size ------------------------------------------------------------------


def test_bytes_appended_to_an_object_are_a_problem(root: Path) -> None:
    """100 bytes appended to a TGB gave exit 0 "OK", though read_footer calls it damaged."""
    store, log, latest = open_log(root)
    ref = log.descriptor(latest, 5).objects[0]
    victim = root / NS / ref.key
    with victim.open("ab") as f:
        f.write(b"\0" * 100)

    with pytest.raises(bw.FormatError, match="longer than the manifest records"):
        read_object_footer(store, log.key(ref.key), ref)
    report = verify(root)
    assert len(report.problems) == 1, report.problems
    problem = report.problems[0]
    assert victim.name in problem
    assert "step 5 " in problem
    assert f"{ref.size} bytes recorded, {ref.size + 100} found" in problem
    result = run("verify", "--footers-only", str(root), NS)
    assert result.returncode == 1, result.stdout
    assert "longer than the manifest records" in " ".join(result.stdout.split())


def test_a_sound_namespace_still_passes_with_every_byte_counted(root: Path) -> None:
    report = verify(root)
    assert report.ok
    assert report.complete
    assert (report.steps, report.steps_unchecked, report.objects) == (STEPS, 0, STEPS)
    data = sum(p.stat().st_size for p in (root / NS / "data").rglob("*.tgb"))
    assert report.bytes_read == data  # the extra byte asked for past each object is not there


# -- the exit status says what verify could not check ------------------------------------------


def test_verify_exits_2_when_only_a_newer_format_kept_it_from_checking(root: Path) -> None:
    """Parts written by a newer BatchWeave: neither pass (0) nor damage (1), but "could not
    run" fully (2), with the steps not checked and the upgrade advice, and no restore advice."""
    bump_trailer_version(tgb_path(root, 6))
    result = run("verify", str(root), NS)
    assert result.returncode == 2, (result.stdout, result.stderr)
    out = " ".join(result.stdout.split())
    assert f"({STEPS - 1}, 1 could not be checked)" in out
    assert "not checked: step 6 " in out
    assert "upgrade batchweave" in out
    assert "INCOMPLETE: no problem found; 1 steps could not be checked" in out
    assert "restore" not in out.lower()
    assert result.stderr.startswith("batchweave: error: verify could not check 1 steps")
    data = json.loads(run("verify", "--json", str(root), NS).stdout)
    assert (data["ok"], data["complete"], data["problems"]) == (False, False, [])
    assert data["steps_unchecked"] == 1
    assert len(data["unchecked"]) == 1


def test_damage_found_exits_1_even_when_parts_could_not_be_checked(root: Path) -> None:
    bump_trailer_version(tgb_path(root, 6))
    tgb_path(root, 11).unlink()
    result = run("verify", str(root), NS)
    assert result.returncode == 1, (result.stdout, result.stderr)
    out = " ".join(result.stdout.split())
    assert "FAILED: 1 problems; 1 steps could not be checked" in out
    assert "not checked: step 6 " in out


# -- 4: exactly-once within one stream ----------------------------------------------------------


@pytest.mark.parametrize(
    ("case", "damage"),
    [("restart, versions reclaimed", True), ("epochs apart", True), ("cannot tell", False)],
)
def test_an_offset_committed_twice_in_one_stream_is_a_problem(
    root: Path, case: str, damage: bool
) -> None:
    """``p`` (offsets 0..11) restarts and commits offset 3 again, with no retirement in between.
    A restart (epoch + 1) is one stream whatever was reclaimed. An epoch far above (a start
    after a retirement takes the version of its epoch commit) is one stream when the versions
    between survive and list ``p``; when one was reclaimed, it could be a new stream of a
    retired ``p``: a note, not damage."""
    store, log, latest = open_log(root)
    old = latest.producers["p"].epoch
    assert latest.version >= old + 2
    epoch = old + 1 if case.startswith("restart") else latest.version + 1
    again = log.descriptor(latest, 3).model_copy(update={"epoch": epoch})
    state = latest.producers["p"].model_copy(update={"epoch": epoch})
    commit_next(store, log, latest, tail=(*latest.tail, again), producers={"p": state})
    reclaimed = {
        "restart, versions reclaimed": range(latest.version + 1),  # all but the newest
        "epochs apart": range(0),
        "cannot tell": range(latest.version, latest.version + 1),
    }[case]
    store.delete_many([log.key(manifest_key(v)) for v in reclaimed])
    report = verify(root)
    if damage:
        assert report.problems == [
            f"step {STEPS}: p offset 3 appears twice",
            f"step {STEPS}: p offset 3 does not follow offset 11 of an earlier step",
        ]
        assert report.notes == []
    else:
        assert report.problems == []
        [note] = report.notes
        assert note.startswith(f"p: the exactly-once check of step {STEPS} was skipped")
        assert report.ok


# -- 5: memory does not grow with the history ---------------------------------------------------


def many_steps(steps: int) -> bw.ObjectStore:
    """``steps`` steps of one producer in segments of 8 steps (all the steps name one object:
    verify reads each step's footer, and the object's key is no check of its)."""
    store = MemoryStore()
    with bw.Producer(store, NS, mesh=bw.Mesh(dp=1), producer_id="p", codec="raw") as p:
        p.append([b"x" * 64], offset=0)
    log = ManifestLog(store, NS, tail_limit=8, max_segment_tgbs=8)
    head = log.latest()
    first = log.descriptor(head, 0)
    while head.next_step < steps:
        stop = min(steps, head.next_step + 8)
        append = [first.model_copy(update={"offset": s}) for s in range(head.next_step, stop)]
        result = log.commit(head, append=append)
        assert isinstance(result, Committed)
        head = result.manifest
    assert len(head.segments) > steps // 8 - 2
    return store


def descriptors_alive() -> int:
    return sum(isinstance(o, TgbDescriptor) for o in gc.get_objects())


def descriptors_held_by_verify(steps: int) -> int:
    """The most descriptors alive while verify checks ``steps`` steps, past those before it."""
    store = many_steps(steps)
    forget_decoded()
    gc.collect()
    before = descriptors_alive()  # the writer's caches (of the build above) hold some
    counts: list[int] = []

    def progress(done: int, total: int) -> None:
        if done % 250 == 0 or done == total:
            counts.append(descriptors_alive() - before)

    report = verify_namespace(store, NS, read_slices=False, workers=2, progress=progress)
    assert report.ok, report.problems
    assert report.steps == steps
    return max(counts)


def test_verify_holds_a_bounded_number_of_descriptors_whatever_the_history() -> None:
    """verify listed every live step's descriptor before checking any (6.4 KB a step at dp=8:
    6.4 GB for a million steps). Read segment by segment and checked in a bounded window, it
    holds what the caches of decoded segments keep (bounded) and its window, whatever the
    history's length: twice the steps, no more descriptors held."""
    small = descriptors_held_by_verify(2000)
    large = descriptors_held_by_verify(4000)
    assert large <= small + 100, (small, large)
    assert large < 1000, (small, large)


# -- a TGB stored as several objects ------------------------------------------------------------


def _object_ref(store: bw.ObjectStore, key: str, tgb: bw.EncodedTgb, first: int) -> TgbObjectRef:
    """Store ``tgb`` under namespace ``NS`` as ``key``; its reference holding slices from
    ``first`` on."""
    store.put_parts(f"{NS}/{key}", tgb.parts)
    return TgbObjectRef(
        key=key,
        size=tgb.size,
        first_slice=first,
        slice_count=len(tgb.footer.slices),
        footer_offset=tgb.footer_offset,
        footer_length=tgb.footer_length,
        footer_checksum=checksum(tgb.footer_bytes, tgb.footer.checksum_algo),
    )


def _one_step(mesh: bw.Mesh, parts: list[tuple[list[bytes], bw.Mesh]]) -> VerifyReport:
    """Verify a namespace of ``mesh`` whose one step is stored as ``parts``, one object each
    (its slices and the mesh its footer carries), in slice order."""
    store = MemoryStore()
    log = ManifestLog(store, NS)
    base = log.create_or_open(mesh)
    refs, first = [], 0
    for i, (payloads, object_mesh) in enumerate(parts):
        key = f"data/ext/0/{0:020d}-{i:032x}.tgb"
        refs.append(_object_ref(store, key, bw.encode_tgb(payloads, object_mesh), first))
        first += len(payloads)
    desc = TgbDescriptor(
        producer_id="ext",
        epoch=0,
        offset=0,
        objects=tuple(refs),
        bytes=sum(ref.size for ref in refs),
        samples=first,
    )
    assert isinstance(log.commit(base, append=[desc]), Committed)
    return verify_namespace(store, NS)


@pytest.mark.parametrize(
    "parts",
    [
        [([b"s0"], bw.Mesh(dp=1)), ([b"s1"], bw.Mesh(dp=1)), ([b"s2", b"s3"], bw.Mesh(dp=1, cp=2))],
        [([b"s0", b"s1", b"s2"], bw.Mesh(dp=3)), ([b"s3"], bw.Mesh(dp=1))],
    ],
)
def test_a_tgb_stored_as_several_objects_is_sound(
    parts: list[tuple[list[bytes], bw.Mesh]],
) -> None:
    # Before: every object of such a TGB was "written for mesh (dp=1 ...)": verify required the
    # namespace's mesh of a footer that holds only the object's own slices (docs/format.md), so
    # no TGB in several objects, which consumers read, could pass.
    report = _one_step(bw.Mesh(dp=2, cp=2), parts)
    assert report.ok, report.problems
    assert report.slices == 4


def test_an_object_holding_a_whole_tgb_must_carry_the_namespace_mesh() -> None:
    report = _one_step(bw.Mesh(dp=2, cp=1), [([b"s0", b"s1"], bw.Mesh(dp=1, cp=2))])
    assert len(report.problems) == 1
    assert "written for mesh (dp=1, cp=2), the namespace's is (dp=2, cp=1)" in report.problems[0]


def test_objects_that_do_not_tile_the_mesh_are_a_problem() -> None:
    report = _one_step(bw.Mesh(dp=2, cp=1), [([b"s0"], bw.Mesh(dp=1))])
    assert report.problems == ["step 0: objects hold 1 slices, the mesh has 2"]
