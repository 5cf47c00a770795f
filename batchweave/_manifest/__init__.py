"""Versioned manifests: the models, their encoding, segments and the commit protocol."""

from batchweave._manifest._codec import (
    MAX_MANIFEST_BYTES,
    MAX_SEGMENT_BYTES,
    decode_manifest,
    decode_segment,
    encode_manifest,
    encode_segment,
)
from batchweave._manifest._log import (
    MANIFESTS_DIR,
    NAMESPACE_DIRS,
    CommitResult,
    Committed,
    Conflict,
    ManifestLog,
    active_producers,
    manifest_key,
)
from batchweave._manifest._models import (
    MANIFEST_FORMAT,
    SEGMENT_FORMAT,
    Manifest,
    ProducerState,
    Segment,
    SegmentRef,
    SliceTable,
    TgbDescriptor,
    TgbObjectRef,
)
from batchweave._manifest._segments import SEGMENTS_DIR

__all__ = [
    "MANIFESTS_DIR",
    "MANIFEST_FORMAT",
    "MAX_MANIFEST_BYTES",
    "MAX_SEGMENT_BYTES",
    "NAMESPACE_DIRS",
    "SEGMENTS_DIR",
    "SEGMENT_FORMAT",
    "CommitResult",
    "Committed",
    "Conflict",
    "Manifest",
    "ManifestLog",
    "ProducerState",
    "Segment",
    "SegmentRef",
    "SliceTable",
    "TgbDescriptor",
    "TgbObjectRef",
    "active_producers",
    "decode_manifest",
    "decode_segment",
    "encode_manifest",
    "encode_segment",
    "manifest_key",
]
