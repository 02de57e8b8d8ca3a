"""The torch-free cut of a chunked delta (``ttpeer._chunked``) is the format's own: the
pieces it finds are ``train.chunk_pieces``'s, and the chunk runs it finds are
``ChunkIndex.span``'s."""

import pytest
import torch

from ttpeer import _chunked, train

pytestmark = pytest.mark.slow  # encodes with torch (no optimizer step, but the tier is torch's)


@pytest.mark.parametrize(("numel", "chunk"), [(4096 * 3, 4096), (4096 * 5 + 17, 4096), (10_000, 8192)])
def test_the_cut_is_the_formats(numel, chunk):
    delta = {"w": torch.randn(numel, generator=torch.Generator().manual_seed(numel))}
    data, _residual = train.encode_delta(delta, None, chunk=chunk)
    lengths = _chunked.piece_lengths(data)
    assert lengths == [len(p) for p in train.chunk_pieces(data)]
    index = train.read_index(data, numel)
    for first, stop in [(0, 1), (1, index.nchunks), (0, index.nchunks)]:
        assert _chunked.chunk_span(data[:index.head_size], first, stop) == index.span(first, stop)


def test_bytes_that_are_not_one_chunked_delta_are_refused():
    delta = {"w": torch.randn(8192)}
    data, _residual = train.encode_delta(delta, None, chunk=4096)
    for bad in [b"", b"TTD1" + data[4:], data[:-1], data + b"x", data[:20]]:
        with pytest.raises(ValueError):
            _chunked.piece_lengths(bad)
    with pytest.raises(ValueError):
        _chunked.chunk_span(data, 1, 3)  # a run past the delta's two chunks
