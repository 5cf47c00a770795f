"""The TGB object format: checksums, slice codecs and the container. Depends only on the store."""

from batchweave._format._checksum import (
    CHECKSUM_ALGOS,
    DEFAULT_CHECKSUM_ALGO,
    ChecksumAlgo,
    checksum,
    checksum_bits,
)
from batchweave._format._codecs import CODECS, COMPRESSIONS, Codec, get_codec
from batchweave._format._tgb import (
    MAGIC,
    MAX_FOOTER_LENGTH,
    TRAILER_SIZE,
    EncodedTgb,
    SliceEntry,
    SliceIndex,
    SliceSpan,
    TgbFooter,
)
from batchweave._format._tgb_read import (
    FOOTER_READ_GUESS,
    FORMAT_VERSION,
    SliceLayout,
    decode_entry,
    decode_slice,
    parse_footer,
    parse_footer_exact,
    read_footer,
    read_slice,
    slice_range,
)
from batchweave._format._tgb_write import TgbBuilder, encode_tgb

__all__ = [
    "CHECKSUM_ALGOS",
    "CODECS",
    "COMPRESSIONS",
    "DEFAULT_CHECKSUM_ALGO",
    "FOOTER_READ_GUESS",
    "FORMAT_VERSION",
    "MAGIC",
    "MAX_FOOTER_LENGTH",
    "TRAILER_SIZE",
    "ChecksumAlgo",
    "Codec",
    "EncodedTgb",
    "SliceEntry",
    "SliceIndex",
    "SliceLayout",
    "SliceSpan",
    "TgbBuilder",
    "TgbFooter",
    "checksum",
    "checksum_bits",
    "decode_entry",
    "decode_slice",
    "encode_tgb",
    "get_codec",
    "parse_footer",
    "parse_footer_exact",
    "read_footer",
    "read_slice",
    "slice_range",
]
