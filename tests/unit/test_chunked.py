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


@pytest.mark.parametrize("bits", [3, 4, 8])
def test_a_chunk_reduced_alone_is_that_run_of_the_slice_and_nothing_else_is(bits):
    # A slice of three chunks of 4096 values and a last one of 1001 (the model's end: an
    # odd count, a part block), quantized as a whole and chunk by chunk.
    mean = torch.randn(3 * 4096 + 1001, generator=torch.Generator().manual_seed(bits))
    whole = train.encode_slice(mean, bits=bits, block=256)
    starts = [0, 4096, 8192, 12288]
    for at, stop in zip(starts, [*starts[1:], mean.numel()], strict=True):
        assert _chunked.run_matches(whole, train.encode_slice(mean[at:stop], bits=bits, block=256), at)
    part = train.encode_slice(mean[4096:8192], bits=bits, block=256)
    assert not _chunked.run_matches(whole, part, 0)  # another chunk's place
    nudged = mean[4096:8192].clone()
    nudged[4000] += 10.0  # one value, far: its block's scale moves
    assert not _chunked.run_matches(whole, train.encode_slice(nudged, bits=bits, block=256), 4096)
    other_bits = 4 if bits != 4 else 8
    assert not _chunked.run_matches(whole, train.encode_slice(mean[4096:8192], bits=other_bits, block=256), 4096)
    with pytest.raises(ValueError):
        _chunked.run_matches(whole, part, 128)  # not on a block
    with pytest.raises(ValueError):
        _chunked.run_matches(whole, part, 12288)  # past the slice's end
    for bad in [whole[:-3], b"TTD2" + whole[4:], whole[:10], b""]:
        with pytest.raises(ValueError):
            _chunked.run_matches(bad, part, 4096)
        with pytest.raises(ValueError):
            _chunked.run_matches(whole, bad, 4096)
