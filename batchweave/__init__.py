"""BatchWeave: a transactional training data plane on object storage.

Producers write immutable Transactional Global Batch (TGB) objects and publish them by committing
versioned manifests with conditional PUTs; each training rank's consumer range-reads only its own
slice, in a global step order every rank agrees on. See ``docs/`` for concepts and formats.
"""

from batchweave._consumer import Consumer, ConsumerStats
from batchweave._errors import (
    AccessDenied,
    AmbiguousWriteError,
    BatchWeaveError,
    ChecksumMismatch,
    ConcurrentWriteConflict,
    ConditionalWritesUnsupported,
    ConsumerError,
    ConsumerTimeout,
    FormatError,
    InvalidKey,
    InvalidStoreURL,
    NamespaceError,
    NamespaceMismatch,
    NamespaceNotFound,
    NamespaceSealed,
    ObjectExists,
    ObjectNotFound,
    OffsetOrderError,
    ProducerError,
    ProducerFenced,
    ProducerRetired,
    SourceMismatch,
    StepReclaimed,
    StoreError,
    StoreTimeout,
    StoreUnavailable,
    TransientStoreError,
    UnsupportedFormatVersion,
)
from batchweave._format import (
    EncodedTgb,
    SliceEntry,
    TgbBuilder,
    TgbFooter,
    decode_slice,
    encode_tgb,
    parse_footer,
    parse_footer_exact,
    read_footer,
    read_slice,
    slice_range,
)
from batchweave._history import SAMPLE_IDS_KEY, sample_ids_metadata
from batchweave._lifecycle import Reclaimer, ReclaimProgress, ReclaimReport, checkpoint_hook
from batchweave._mesh import Mesh
from batchweave._metrics import instrument_policy, start_metrics_server, track_metrics
from batchweave._policy import (
    AttemptOutcome,
    CommitPolicy,
    DacPolicy,
    dac_gap,
    make_policy,
    policy_names,
)
from batchweave._producer import Producer, ProducerStats
from batchweave._projection import RankCoordinates, coordinates_for_rank, coordinates_from_env
from batchweave._retire import RetireReport, retire_producers
from batchweave._store._base import (
    Bounded,
    ByteRange,
    ObjectMeta,
    ObjectStore,
    Offset,
    PutMode,
    Suffix,
    validate_key,
)
from batchweave._store._file import FileStore
from batchweave._store._memory import MemoryStore
from batchweave._store._obstore import ObstoreS3Store
from batchweave._store._open import ensure_conditional_writes, open_store
from batchweave._store._s3 import S3Store
from batchweave._store._wrappers import (
    CountingStore,
    FaultInjectingStore,
    StoreCounts,
    StoreWrapper,
)
from batchweave._watermarks import Watermark, Watermarks

__version__ = "0.1.0"

__all__ = [
    "AccessDenied",
    "AmbiguousWriteError",
    "AttemptOutcome",
    "BatchWeaveError",
    "Bounded",
    "ByteRange",
    "ChecksumMismatch",
    "CommitPolicy",
    "ConcurrentWriteConflict",
    "ConditionalWritesUnsupported",
    "Consumer",
    "ConsumerError",
    "ConsumerStats",
    "ConsumerTimeout",
    "CountingStore",
    "DacPolicy",
    "EncodedTgb",
    "FaultInjectingStore",
    "FileStore",
    "FormatError",
    "InvalidKey",
    "InvalidStoreURL",
    "MemoryStore",
    "Mesh",
    "NamespaceError",
    "NamespaceMismatch",
    "NamespaceNotFound",
    "NamespaceSealed",
    "ObjectExists",
    "ObjectMeta",
    "ObjectNotFound",
    "ObjectStore",
    "ObstoreS3Store",
    "Offset",
    "OffsetOrderError",
    "Producer",
    "ProducerError",
    "ProducerFenced",
    "ProducerRetired",
    "ProducerStats",
    "PutMode",
    "RankCoordinates",
    "ReclaimProgress",
    "ReclaimReport",
    "Reclaimer",
    "RetireReport",
    "S3Store",
    "SAMPLE_IDS_KEY",
    "SliceEntry",
    "SourceMismatch",
    "StepReclaimed",
    "StoreCounts",
    "StoreError",
    "StoreTimeout",
    "StoreUnavailable",
    "StoreWrapper",
    "Suffix",
    "TgbBuilder",
    "TgbFooter",
    "TransientStoreError",
    "UnsupportedFormatVersion",
    "Watermark",
    "Watermarks",
    "checkpoint_hook",
    "coordinates_for_rank",
    "coordinates_from_env",
    "dac_gap",
    "decode_slice",
    "encode_tgb",
    "instrument_policy",
    "make_policy",
    "ensure_conditional_writes",
    "open_store",
    "parse_footer",
    "parse_footer_exact",
    "policy_names",
    "read_footer",
    "read_slice",
    "retire_producers",
    "sample_ids_metadata",
    "slice_range",
    "start_metrics_server",
    "track_metrics",
    "validate_key",
    "__version__",
]
