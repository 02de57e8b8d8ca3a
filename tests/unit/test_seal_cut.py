"""Pool sealing in cut pieces (``seal_cut``): a chunked delta sealed so that any run of
its chunks opens from its own bytes and the clear table, and no piece may be changed,
moved, taken from another blob or opened under another key or purpose."""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ttpeer import train
from ttpeer.net._seal import (
    CUT_HEADER,
    MAX_CUT_PIECE,
    TAG,
    SealError,
    cut_head_size,
    cut_table,
    open_cut,
    open_sealed,
    seal_cut,
)

KEY, OTHER = os.urandom(32), os.urandom(32)


def _pieces(sizes: list[int]) -> list[bytes]:
    return [os.urandom(n) for n in sizes]


@given(st.lists(st.integers(0, 3000), min_size=1, max_size=12), st.data())
@settings(max_examples=40, deadline=None)
def test_any_run_of_pieces_opens_from_its_own_bytes(sizes, data):
    pieces = _pieces(sizes)
    blob = seal_cut(KEY, b"blob", pieces)
    table = cut_table(blob[:cut_head_size(blob[:CUT_HEADER])])
    assert table.lengths == tuple(sizes) and len(blob) == table.size + sum(sizes) + len(sizes) * TAG
    first = data.draw(st.integers(0, len(sizes) - 1))
    stop = data.draw(st.integers(first + 1, len(sizes)))
    begin, end = table.span(first, stop)
    assert open_cut(KEY, b"blob", table, first, stop, blob[begin:end]) == pieces[first:stop]
    assert open_sealed(KEY, b"blob", blob) == b"".join(pieces)  # and whole, as any pool blob


def test_a_chunked_delta_sealed_in_cut_pieces_gives_a_slice_exactly_its_chunks():
    g = torch.Generator().manual_seed(0)
    delta = {"v": torch.randn(5 * 4096 + 7, generator=g) * 1e-2}
    data, _ = train.encode_delta(delta, None, chunk=4096)
    blob = seal_cut(KEY, b"blob", train.chunk_pieces(data))
    table = cut_table(blob)
    head = open_cut(KEY, b"blob", table, 0, 1, blob[slice(*table.span(0, 1))])[0]
    index = train.read_index(head, delta["v"].numel())
    # Chunks 2..3 are pieces 3..4: fetched as exactly their bytes, decoded as the whole delta decodes.
    begin, end = table.span(3, 5)
    frames = b"".join(open_cut(KEY, b"blob", table, 3, 5, blob[begin:end]))
    assert end - begin == sum(index.lengths[2:4]) + 2 * TAG
    whole = train.decode_delta(data, train.OuterState(params={"v": delta["v"]}, momentum={}))["v"]
    assert torch.equal(train.decode_chunks(index, frames, 2, 4), whole[2 * 4096:4 * 4096])
    with pytest.raises(train.DeltaError, match="not a chunked"):
        train.chunk_pieces(train.encode_delta(delta, None)[0])


def test_changed_moved_foreign_or_cut_pieces_do_not_open():
    pieces = _pieces([100, 200, 300])
    blob = seal_cut(KEY, b"blob", pieces)
    table = cut_table(blob)
    b1, e1 = table.span(1, 2)
    flipped = bytearray(blob)
    flipped[b1 + 5] ^= 1
    for key, purpose, data, first, stop in [
        (OTHER, b"blob", blob[b1:e1], 1, 2),  # another pool key
        (KEY, b"ckpt", blob[b1:e1], 1, 2),  # another purpose
        (KEY, b"blob", bytes(flipped[b1:e1]), 1, 2),  # one bit changed
        (KEY, b"blob", blob[slice(*table.span(2, 3))][:e1 - b1], 1, 2),  # piece 2 where piece 1 belongs
        (KEY, b"blob", seal_cut(KEY, b"blob", pieces)[b1:e1], 1, 2),  # the same bytes sealed again: another salt
    ]:
        with pytest.raises(SealError, match="does not authenticate"):
            open_cut(key, purpose, table, first, stop, data)
    with pytest.raises(SealError, match="sealed bytes; got"):
        open_cut(KEY, b"blob", table, 1, 2, blob[b1:e1 - 1])
    # A table that lies about the lengths opens nothing: every piece binds the table.
    lying = cut_table(blob[:CUT_HEADER] + (101).to_bytes(4, "little") + (199).to_bytes(4, "little") + blob[32:])
    with pytest.raises(SealError, match="does not authenticate"):
        open_cut(KEY, b"blob", lying, 0, 1, blob[slice(*lying.span(0, 1))])
    # A blob cut off after its second piece: the table still names three, so it does not open whole.
    with pytest.raises(SealError):
        open_sealed(KEY, b"blob", blob[:e1])


def test_hostile_heads_are_refused_with_seal_error():
    blob = seal_cut(KEY, b"blob", _pieces([10]))
    for head, message in [
        (blob[:10], "bad magic or cut short"),
        (b"TS2S" + blob[4:], "bad magic"),
        (blob[:20] + (0).to_bytes(4, "little"), "claims 0 pieces"),
        (blob[:20] + (1 << 20).to_bytes(4, "little"), "at most"),
        (blob[:CUT_HEADER], "its table needs"),
        (blob[:CUT_HEADER] + (MAX_CUT_PIECE + 1).to_bytes(4, "little"), "a piece over"),
    ]:
        with pytest.raises(SealError, match=message):
            cut_table(head)
    with pytest.raises(ValueError, match="pieces of at most"):
        seal_cut(KEY, b"blob", [])
    with pytest.raises(ValueError, match="not a run"):
        cut_table(blob).span(0, 2)
