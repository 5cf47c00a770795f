"""The footer parser's fast path accepts nothing the full pydantic validation would reject.

``_fast_footer`` validates footers as the writer lays them out with plain integer checks and
defers everything else to the general path (pydantic plus ``_check_footer``). Property: for any
footer document, valid or mutated, the fast path either declines (``None``) or returns exactly
the footer the general path returns; and canonical footers always take the fast path.
"""

from __future__ import annotations

import json
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from batchweave import Mesh, encode_tgb
from batchweave._errors import FormatError
from batchweave._format import CHECKSUM_ALGOS
from batchweave._format._tgb import TgbFooter
from batchweave._format._tgb_read import _check_footer, _fast_footer

_FIELDS = ("offset", "length", "uncompressed_length", "checksum", "sample_count")
_ODD_VALUES: st.SearchStrategy[Any] = st.one_of(
    st.integers(min_value=-(1 << 70), max_value=1 << 70),
    st.sampled_from([True, False, None, 1.0, 2.5, "3", [], {}, 1 << 64, (1 << 32) - 1]),
)


@st.composite
def _footer_docs(draw: st.DrawFn) -> dict[str, Any]:
    dp = draw(st.integers(1, 4))
    cp = draw(st.integers(1, 3))
    payloads = [draw(st.binary(max_size=6)) for _ in range(dp * cp)]
    enc = encode_tgb(
        payloads,
        Mesh(dp=dp, cp=cp),
        compression=draw(st.sampled_from([None, "zstd"])),
        checksum_algo=draw(st.sampled_from(CHECKSUM_ALGOS)),
    )
    doc: dict[str, Any] = json.loads(enc.footer.model_dump_json())
    return doc


def _general(doc: Any) -> TgbFooter | None:
    try:
        footer = TgbFooter.model_validate(doc)
        _check_footer(footer, "k")
    except (ValidationError, FormatError):
        return None
    return footer


@settings(max_examples=60, deadline=None)
@given(doc=_footer_docs())
def test_canonical_footers_take_the_fast_path(doc: dict[str, Any]) -> None:
    fast = _fast_footer(json.loads(json.dumps(doc)))
    assert fast is not None
    assert fast == _general(doc)
    assert json.loads(fast.model_dump_json()) == doc


@settings(max_examples=300, deadline=None)
@given(doc=_footer_docs(), data=st.data())
def test_fast_path_never_accepts_more_than_the_general_path(
    doc: dict[str, Any], data: st.DataObject
) -> None:
    slices = doc["slices"]
    action = data.draw(st.sampled_from(["field", "extra", "drop", "swap", "top"]))
    i = data.draw(st.integers(0, len(slices) - 1))
    if action == "field":
        slices[i][data.draw(st.sampled_from(_FIELDS))] = data.draw(_ODD_VALUES)
    elif action == "extra":
        slices[i]["extra"] = 1
    elif action == "drop":
        del slices[i][data.draw(st.sampled_from(_FIELDS))]
    elif action == "swap":
        j = data.draw(st.integers(0, len(slices) - 1))
        slices[i], slices[j] = slices[j], slices[i]
    else:
        name = data.draw(st.sampled_from(["payload_length", "compression", "checksum_algo"]))
        doc[name] = data.draw(
            st.one_of(_ODD_VALUES, st.sampled_from(["zstd", *CHECKSUM_ALGOS, "x"]))
        )
    general = _general(json.loads(json.dumps(doc)))
    fast = _fast_footer(json.loads(json.dumps(doc)))
    assert fast is None or fast == general
