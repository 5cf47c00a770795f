"""BatchWeave: a transactional training data plane on object storage.

Producers write immutable Transactional Global Batch (TGB) objects and publish them by committing
versioned manifests with conditional PUTs; each training rank's consumer range-reads only its own
slice, in a global step order every rank agrees on. See ``docs/`` for concepts and formats.
"""

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
    ObjectExists,
    ObjectNotFound,
    OffsetOrderError,
    ProducerError,
    ProducerFenced,
    StoreError,
    StoreUnavailable,
    TransientStoreError,
    UnsupportedFormatVersion,
)
from batchweave._mesh import Mesh
from batchweave._store._base import (
    Bounded,
    ByteRange,
    ObjectMeta,
    ObjectStore,
    Offset,
    PutMode,
    Suffix,
)
from batchweave._store._memory import MemoryStore

__version__ = "0.1.0"

__all__ = [
    "AccessDenied",
    "AmbiguousWriteError",
    "BatchWeaveError",
    "Bounded",
    "ByteRange",
    "ChecksumMismatch",
    "ConcurrentWriteConflict",
    "ConditionalWritesUnsupported",
    "ConsumerError",
    "ConsumerTimeout",
    "FormatError",
    "InvalidKey",
    "InvalidStoreURL",
    "MemoryStore",
    "Mesh",
    "NamespaceError",
    "NamespaceMismatch",
    "NamespaceNotFound",
    "ObjectExists",
    "ObjectMeta",
    "ObjectNotFound",
    "ObjectStore",
    "Offset",
    "OffsetOrderError",
    "ProducerError",
    "ProducerFenced",
    "PutMode",
    "StoreError",
    "StoreUnavailable",
    "Suffix",
    "TransientStoreError",
    "UnsupportedFormatVersion",
    "__version__",
]
