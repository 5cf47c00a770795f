"""A producer's TGBs: encoding what ``append`` is given, and describing an uploaded one.

What turns slices (or a TGB built by the caller) into the bytes to upload and the descriptor a
commit records depends only on the producer's encoding settings and its identity, not on its
threads or commit state; it is kept here, apart from the machinery that uploads and commits.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from batchweave._errors import FormatError
from batchweave._format._checksum import CHECKSUM_ALGOS, ChecksumAlgo, checksum
from batchweave._format._codecs import check_compression, get_codec
from batchweave._format._tgb import EncodedTgb
from batchweave._format._tgb_write import TgbBuilder, check_encoded, encode_tgb, payload_list
from batchweave._manifest._models import SliceTable, TgbDescriptor, TgbObjectRef
from batchweave._mesh import Mesh
from batchweave._unchecked import unchecked

__all__ = ["DEFAULT_SLICE_TABLE_LIMIT", "Entry", "TgbEncoder", "describe"]

DEFAULT_SLICE_TABLE_LIMIT = 128
"""Meshes of up to 128 slices copy their slice table into the manifest (under 1 KB a TGB of
equal-sized slices: a 4-byte checksum per slice, 8 with a 64-bit ``checksum_algo``, base64)."""


@dataclass
class Entry:
    """One appended TGB until it is committed."""

    offset: int
    key: str
    """Object key relative to the namespace root."""
    size: int
    descriptor: TgbDescriptor | None = None
    """Set once the object is uploaded: only then may a commit reference it."""
    state: Literal["new", "queued", "uploading", "withdrawn"] = "new"
    """``queued`` once ``append`` registered it, ``uploading`` once an upload thread took it;
    ``withdrawn`` when an interrupted ``append`` took it back before that (its upload, if one
    was queued after all, then does nothing). Guarded by the producer's condition."""
    charged: bool = False
    """Whether its ``size`` counts in the producer's bytes in flight: released exactly once
    (upload done or failed, upload cancelled, or taken back), whichever comes first."""


class TgbEncoder:
    """Encodes the TGBs of one producer: its payloads with its settings, or TGBs built elsewhere.

    Construction checks the encoding settings (checksum algorithm, codec, compression), so a
    typo is refused before the epoch commit rather than at the first ``append``.
    """

    def __init__(
        self,
        producer_id: str,
        namespace: str,
        mesh: Mesh,
        *,
        codec: str,
        compression: str | None,
        checksum_algo: ChecksumAlgo,
    ) -> None:
        if checksum_algo not in CHECKSUM_ALGOS:
            raise ValueError(
                f"producer {producer_id!r}: unknown checksum_algo {checksum_algo!r}; expected "
                f"one of {', '.join(map(repr, CHECKSUM_ALGOS))}"
            )
        # Checked before the epoch commit: a typo must not wait for the first append.
        try:
            get_codec(codec)
            check_compression(compression)
        except ValueError as exc:
            raise ValueError(f"producer {producer_id!r}: {exc}") from None
        self._producer_id = producer_id
        self._namespace = namespace
        self._mesh = mesh
        self._codec = codec
        self._compression = compression
        self._checksum_algo: ChecksumAlgo = checksum_algo

    def encode(
        self,
        slices: Iterable[Any] | EncodedTgb | TgbBuilder,
        offset: int,
        sample_counts: Iterable[int | None] | None,
        metadata: Mapping[str, str] | None,
    ) -> EncodedTgb:
        """The TGB for ``offset``: built from payloads, or the caller's own, checked."""
        if isinstance(slices, TgbBuilder):
            slices = slices.build()
        elif isinstance(slices, EncodedTgb):
            # Built elsewhere: its footer object (which the manifest records) must be the one
            # its bytes hold, or the committed step would be unreadable.
            check_encoded(slices, what=f"TGB for offset {offset}")
        if isinstance(slices, EncodedTgb):
            if sample_counts is not None or metadata is not None:
                raise ValueError(
                    "sample_counts and metadata belong to the encoder; pass them to the "
                    "TgbBuilder / encode_tgb that built this TGB"
                )
            if slices.footer.mesh != self._mesh:
                raise ValueError(
                    f"TGB for offset {offset} was built for mesh {slices.footer.mesh}, but "
                    f"namespace {self._namespace!r} has mesh {self._mesh}"
                )
            return slices
        slices = payload_list(slices, self._mesh)
        if len(slices) != self._mesh.slices:
            raise ValueError(
                f"producer {self._producer_id!r}: offset {offset} got {len(slices)} slices; mesh "
                f"{self._mesh} needs dp*cp = {self._mesh.slices} payloads in (d, c) order"
            )
        return encode_tgb(
            slices,
            self._mesh,
            codec=self._codec,
            compression=self._compression,
            checksum_algo=self._checksum_algo,
            sample_counts=sample_counts,
            metadata=metadata,
        )


def describe(
    entry: Entry,
    encoded: EncodedTgb,
    *,
    producer_id: str,
    epoch: int,
    slice_table_limit: int,
    validate: bool = True,
) -> TgbDescriptor:
    """The descriptor of ``encoded``, uploaded as ``entry`` by ``producer_id`` at ``epoch``.

    Its slice table is copied into the descriptor if it has at most ``slice_table_limit`` slices.

    ``validate=False`` only for a TGB this producer encoded from payloads itself: codec,
    compression and checksum algorithm were checked at start, the footer by the encoder,
    and key, epoch and offset are ours, so every model is valid by construction and equals
    the validated one (tests compare both). A TGB the caller built is validated, in the
    caller's thread before it is uploaded: one a manifest cannot record (a footer naming an
    unknown codec, say) raises :class:`FormatError` there.
    """
    if not validate:
        return _describe(entry, encoded, producer_id, epoch, slice_table_limit, validate=False)
    try:
        return _describe(entry, encoded, producer_id, epoch, slice_table_limit, validate=True)
    except ValueError as exc:  # a pydantic ValidationError
        raise FormatError(
            f"TGB for offset {entry.offset} cannot be recorded in a manifest, so it is not "
            f"appended: {exc}"
        ) from exc


def _describe(
    entry: Entry,
    encoded: EncodedTgb,
    producer_id: str,
    epoch: int,
    slice_table_limit: int,
    *,
    validate: bool,
) -> TgbDescriptor:
    footer = encoded.footer
    table = (
        SliceTable.from_footer(footer, validate=validate)
        if len(footer.slices) <= slice_table_limit
        else None
    )
    ref_fields: dict[str, Any] = {
        "key": entry.key,
        "size": encoded.size,
        "first_slice": 0,
        "slice_count": len(footer.slices),
        "footer_offset": encoded.footer_offset,
        "footer_length": encoded.footer_length,
        "footer_checksum": checksum(encoded.footer_bytes, footer.checksum_algo),
        "slices": table,
    }
    ref = TgbObjectRef(**ref_fields) if validate else unchecked(TgbObjectRef, ref_fields)
    fields: dict[str, Any] = {
        "producer_id": producer_id,
        "epoch": epoch,
        "offset": entry.offset,
        "objects": (ref,),
        "bytes": encoded.size,
        "samples": sum([s.sample_count for s in footer.slices]),
    }
    return TgbDescriptor(**fields) if validate else unchecked(TgbDescriptor, fields)
