"""Manifest decoding: each version decoded with the one read before it, against decoding afresh.

A commit copies its base's tail into the version it writes, so consecutive versions share most of
their tail. A ``ManifestLog`` decodes each version with the newest one it read before and takes
the shared descriptors from it instead of validating them again (``docs/protocol.md``). This
benchmark builds a chain of versions, each appending ``new`` descriptors to a tail of at most
``tail`` descriptors (the oldest leave it, as they would into a segment), and decodes the whole
chain in order twice in the same process: afresh (the baseline: every descriptor validated in
every version) and with the previous version. It reports the median time per version and the
ratio. Descriptors carry a slice table of ``slices`` slices (the manifest holds one for meshes of
up to 128 slices).

    python bench/manifests.py           # tails 64 and 256, 1 and 16 new, 8 and 128 slices
    python bench/manifests.py --smoke
"""

from __future__ import annotations

import random
import statistics
import sys
import time
from pathlib import Path

_REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(_REPO / "bench"))

from _report import Report, parser  # noqa: E402

from batchweave import Mesh  # noqa: E402
from batchweave._manifest import (  # noqa: E402
    Manifest,
    SliceTable,
    TgbDescriptor,
    TgbObjectRef,
    decode_manifest,
    encode_manifest,
)
from batchweave._manifest._codec import forget_decoded  # noqa: E402

SLICE_BYTES = 100_000
KEY = "bench/_manifests/{:020d}.manifest"


def descriptor(rng: random.Random, producer: int, offset: int, slices: int) -> TgbDescriptor:
    """A descriptor as a producer writes it: one object with its slice table."""
    table = SliceTable(
        codec="raw",
        checksum_algo="crc32c",
        lengths=(SLICE_BYTES,) * slices,
        checksums=tuple(rng.getrandbits(32) for _ in range(slices)),
        sample_counts=(1,) * slices,
    )
    payload = SLICE_BYTES * slices
    ref = TgbObjectRef(
        key=f"data/p{producer}/1/{offset:020d}-{rng.getrandbits(128):032x}.tgb",
        size=payload + 600,
        slice_count=slices,
        footer_offset=payload,
        footer_length=600,
        footer_checksum=rng.getrandbits(32),
        slices=table,
    )
    return TgbDescriptor(
        producer_id=f"p{producer}", epoch=1, offset=offset, objects=(ref,), bytes=ref.size
    )


def chain(versions: int, tail: int, new: int, slices: int, producers: int = 16) -> list[bytes]:
    """The encoded versions 1..``versions``, each ``new`` descriptors after the one before."""
    rng = random.Random(f"{tail}-{new}-{slices}")
    made: list[TgbDescriptor] = []
    out = []
    for version in range(1, versions + 1):
        for _ in range(new):
            step = len(made)
            made.append(descriptor(rng, step % producers, step // producers, slices))
        kept = made[-tail:]
        manifest = Manifest(
            namespace_id="bench",
            mesh=Mesh(dp=slices),
            version=version,
            parent=version - 1,
            commit_id=f"{rng.getrandbits(128):032x}",
            created_at=1.8e9 + version,
            base_step=len(made) - len(kept),
            tail=tuple(kept),
            tail_start=len(made) - len(kept),
        )
        out.append(encode_manifest(manifest))
    return out


def decode_chain(encoded: list[bytes], reuse: bool) -> list[float]:
    """Seconds to decode each version in order, with the previous one when ``reuse``."""
    forget_decoded()
    previous: Manifest | None = None
    seconds = []
    for version, data in enumerate(encoded, start=1):
        start = time.perf_counter()
        manifest = decode_manifest(data, key=KEY.format(version), previous=previous)
        seconds.append(time.perf_counter() - start)
        previous = manifest if reuse else None
    return seconds


def main() -> int:
    p = parser(__doc__.split("\n", 1)[0] if __doc__ else None)
    p.add_argument("--versions", type=int, default=None, help="versions per chain (default 300)")
    args = p.parse_args()
    versions = args.versions or (20 if args.smoke else 300)
    points = (
        [(16, 1, 8)]
        if args.smoke
        else [(t, n, s) for s in (8, 128) for t in (64, 256) for n in (1, 16)]
    )
    report = Report(
        name="manifests" + ("-smoke" if args.smoke else ""),
        columns=[
            "slices",
            "tail",
            "new",
            "KB/version",
            "afresh us",
            "with previous us",
            "speed-up",
        ],
    )
    for tail, new, slices in points:
        encoded = chain(versions, tail, new, slices)
        # Rounds alternate the two modes, so load drifting on a shared machine hits both alike.
        fresh, reused = [], []
        for _ in range(3):
            fresh += decode_chain(encoded, reuse=False)
            reused += decode_chain(encoded, reuse=True)
        # The first versions have short tails: measure where the tail has reached its bound.
        full = versions * 3 // 4
        a = statistics.median(fresh[-full:]) * 1e6
        b = statistics.median(reused[-full:]) * 1e6
        report.add(
            slices=slices,
            tail=tail,
            new=new,
            **{
                "KB/version": len(encoded[-1]) / 1024,
                "afresh us": a,
                "with previous us": b,
                "speed-up": a / b,
            },
        )
        print(f"slices {slices} tail {tail} new {new}: {a:.0f} us -> {b:.0f} us", flush=True)
    report.notes += [
        f"{versions} versions per chain, decoded in order 3 times in each mode (alternating); "
        "medians over the last three quarters of each chain",
        "afresh: every version validated whole (the baseline); with previous: the tail "
        "descriptors shared with the version before are taken from it",
    ]
    report.emit(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
