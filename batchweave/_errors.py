"""Every error BatchWeave raises, in one tree.

Catch ``BatchWeaveError`` to handle anything from this library; catch a leaf to handle one
situation. Leaves subclass a built-in where one fits, so ``except FileNotFoundError`` keeps
working for callers that do not know BatchWeave.

::

    BatchWeaveError
    ├── StoreError                     the object store failed or refused a request
    │   ├── ObjectNotFound             (FileNotFoundError) no object under that key
    │   ├── ObjectExists               (FileExistsError) create-if-absent found the key taken
    │   ├── TransientStoreError        retrying later may succeed (5xx, throttling, resets)
    │   │   ├── ConcurrentWriteConflict  409: another conditional write to the key is in flight
    │   │   └── StoreTimeout           (TimeoutError) a read, listing or delete got no answer
    │   ├── AmbiguousWriteError        a write whose outcome is unknown: read back to decide
    │   ├── StoreUnavailable           (ConnectionError) endpoint unreachable after retries
    │   ├── AccessDenied               (PermissionError) credentials missing, wrong or unauthorized
    │   ├── InvalidKey                 (ValueError) a key that is unsafe or malformed
    │   ├── InvalidStoreURL            (ValueError) open_store got a URL it cannot use
    │   └── ConditionalWritesUnsupported  the store ignores If-None-Match: refusing to use it
    ├── FormatError                    (ValueError) bytes that are not what they claim to be
    │   ├── ChecksumMismatch           stored and computed checksums differ
    │   └── UnsupportedFormatVersion   written by a newer BatchWeave: upgrade to read it
    ├── NamespaceError                 the namespace does not fit this client
    │   ├── NamespaceNotFound          (FileNotFoundError) nothing committed under the prefix
    │   ├── NamespaceMismatch          other mesh, other namespace id, or a foreign prefix
    │   ├── NamespaceSealed            the stream was sealed: no more TGBs can be committed
    │   └── StepReclaimed              (IndexError) the step is below the reclamation boundary
    ├── ProducerError
    │   ├── ProducerFenced             a newer incarnation of this producer id has started
    │   │   └── ProducerRetired        this producer id was retired (retire_producers)
    │   ├── OffsetOrderError           (ValueError) offsets must strictly increase
    │   └── SourceMismatch             the id's committed source differs: offsets mean other data
    └── ConsumerError
        └── ConsumerTimeout            (TimeoutError) no new step arrived in time
"""

from __future__ import annotations

__all__ = [
    "AccessDenied",
    "AmbiguousWriteError",
    "BatchWeaveError",
    "ChecksumMismatch",
    "ConcurrentWriteConflict",
    "ConditionalWritesUnsupported",
    "ConsumerError",
    "ConsumerTimeout",
    "FormatError",
    "InvalidKey",
    "InvalidStoreURL",
    "NamespaceError",
    "NamespaceMismatch",
    "NamespaceNotFound",
    "NamespaceSealed",
    "ObjectExists",
    "ObjectNotFound",
    "OffsetOrderError",
    "ProducerError",
    "ProducerFenced",
    "ProducerRetired",
    "SourceMismatch",
    "StepReclaimed",
    "StoreError",
    "StoreTimeout",
    "StoreUnavailable",
    "TransientStoreError",
    "UnsupportedFormatVersion",
]


class BatchWeaveError(Exception):
    """Root of every error raised by BatchWeave."""


class StoreError(BatchWeaveError):
    """The object store failed or refused a request."""


class ObjectNotFound(StoreError, FileNotFoundError):
    """No object exists under the requested key."""


class ObjectExists(StoreError, FileExistsError):
    """A create-if-absent write found the key already taken (HTTP 412).

    On S3 a 412 can come from the SDK's own retry of a write that already landed, so callers that
    care (the commit protocol) read the object back before deciding who won.
    """


class TransientStoreError(StoreError):
    """A failure that may succeed when retried later: 5xx, throttling, connection resets."""


class ConcurrentWriteConflict(TransientStoreError):
    """HTTP 409 ConditionalRequestConflict: another conditional write to the key is in flight."""


class StoreTimeout(TransientStoreError, TimeoutError):
    """A read, listing or delete reached the store but got no answer in time (a read timeout).

    The store accepted the connection (and the request) and did not answer within
    ``read_timeout``: an overloaded or hung server, or not an S3 server on that port. Retrying
    later may succeed; a client that waits for the store counts it as an outage, like
    :class:`StoreUnavailable`. A write that timed out is an :class:`AmbiguousWriteError` with
    ``timed_out`` set instead: it may have landed.
    """


class AmbiguousWriteError(StoreError):
    """A write whose outcome is unknown (timeout or reset after the body was sent).

    The object may or may not exist now. Read it back to decide; never assume either way.
    """

    timed_out: bool = False
    """Whether the write's last attempt got no answer in time (a read timeout), as opposed to
    a reset, a 5xx or a refusal after an earlier attempt that may have landed. Set by the S3
    backends on the instance they raise."""


class StoreUnavailable(StoreError, ConnectionError):
    """The store's endpoint could not be reached, even after retries."""


class AccessDenied(StoreError, PermissionError):
    """Credentials are missing, wrong, or not allowed to perform the request."""


class InvalidKey(StoreError, ValueError):
    """A key that is empty, malformed, or would escape the store's root."""


class InvalidStoreURL(StoreError, ValueError):
    """``open_store`` received a URL or option it cannot use."""


class ConditionalWritesUnsupported(StoreError):
    """The store accepted a second create-if-absent of the same key.

    Such a store silently ignores ``If-None-Match: *``; committing manifests on it would lose
    data, so BatchWeave refuses to use it.
    """


class FormatError(BatchWeaveError, ValueError):
    """Bytes that are not a valid BatchWeave object: truncated, corrupt, or foreign."""


class ChecksumMismatch(FormatError):
    """The checksum stored for a slice, footer or manifest differs from the computed one."""


class UnsupportedFormatVersion(FormatError):
    """The object was written in a format version newer than this library understands."""


class NamespaceError(BatchWeaveError):
    """The namespace does not fit this client."""


class NamespaceNotFound(NamespaceError, FileNotFoundError):
    """No namespace has been created under the prefix yet."""


class NamespaceMismatch(NamespaceError):
    """The namespace has another mesh or id than requested, or the prefix holds something else."""


class NamespaceSealed(NamespaceError):
    """The namespace was sealed by a final commit; it accepts no more TGBs."""


class StepReclaimed(NamespaceError, IndexError):
    """The step lies below the manifest's ``base_step``: its TGB was reclaimed."""


class ProducerError(BatchWeaveError):
    """A producer cannot continue."""


class ProducerFenced(ProducerError):
    """A newer incarnation (higher epoch) of this producer id has started; this one must stop."""


class ProducerRetired(ProducerFenced):
    """This producer id was retired (:func:`~batchweave.retire_producers`); this one must stop."""


class OffsetOrderError(ProducerError, ValueError):
    """A TGB was appended with an offset not greater than the previous one."""


class SourceMismatch(ProducerError):
    """The producer id's committed ``source`` differs from the one this producer was given.

    Its offsets would map to other data than the committed ones (a dataset read at another
    version, another shard or seed), so resuming would publish other rows under the resumed
    offsets. Raised at start, before anything is committed.
    """


class ConsumerError(BatchWeaveError):
    """A consumer cannot deliver the next step."""


class ConsumerTimeout(ConsumerError, TimeoutError):
    """No new step became visible within the consumer's timeout."""
