"""Aggregation slices, the tensor part: the chunked delta format (TTD2) decodes to the
same bits as TTD1, any run of chunks decodes from its own bytes, hostile bytes are
refused; a slice's reduction is the mean of all deltas there, bit for bit; re-quantized
slices are the blocks of the whole mean; the outer step on the slices' mean."""

import struct

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ttpeer import train
from ttpeer.proto._slices import slice_chunks
from ttpeer.train import DeltaError, OuterState, decode_delta, encode_delta

torch.set_num_threads(1)

CHUNK = 4096
HEAD = struct.calcsize("<4sBIQI")  # magic, bits, block, values, chunk
# 3 tensors, 10000 values: two whole chunks of 4096 and a short third one.
SHAPES = {"a.weight": (60, 100), "a.bias": (1000,), "b.weight": (3000,)}


def _like(shapes=SHAPES) -> OuterState:
    params = {n: torch.zeros(s) for n, s in shapes.items()}
    return OuterState(params=params, momentum={n: t.clone() for n, t in params.items()})


def _delta(seed: int, shapes=SHAPES, scale: float = 1e-2) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(s, generator=g) * scale for n, s in shapes.items()}


def _flat(tensors) -> torch.Tensor:
    return torch.cat([tensors[n].reshape(-1) for n in sorted(tensors)])


def _bits(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.int32).numpy().tobytes()


def _numel(shapes=SHAPES) -> int:
    return sum(torch.zeros(s).numel() for s in shapes.values())


@pytest.mark.parametrize("bits,block,chunk", [(8, 256, 4096), (8, 16, 8192), (4, 64, 4096), (4, 4096, 4096),
                                              (3, 256, 4096)])
def test_chunked_deltas_decode_to_the_same_bits_as_one_frame(bits, block, chunk):
    delta = _delta(0)
    one, residual_one = encode_delta(delta, None, bits=bits, block=block)
    chunked, residual_chunked = encode_delta(delta, None, bits=bits, block=block, chunk=chunk)
    assert chunked[:4] == b"TTD2" and one[:4] == b"TTD1"
    assert _bits(_flat(decode_delta(chunked, _like()))) == _bits(_flat(decode_delta(one, _like())))
    assert _bits(_flat(residual_chunked)) == _bits(_flat(residual_one))  # the same quantization


@given(numel=st.integers(1, 3 * CHUNK + 5), bits=st.sampled_from([4, 8]), data=st.data())
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_any_run_of_chunks_decodes_from_its_own_bytes_as_the_whole_does(numel, bits, data):
    shapes = {"v": (numel,)}
    blob, _ = encode_delta(_delta(numel, shapes), None, bits=bits, block=64, chunk=CHUNK)
    whole = _flat(decode_delta(blob, _like(shapes)))
    index = train.read_index(blob[:train.head_size(blob)], numel)
    assert index.size == len(blob) and index.nchunks == -(-numel // CHUNK)
    first = data.draw(st.integers(0, index.nchunks - 1))
    stop = data.draw(st.integers(first + 1, index.nchunks))
    begin, end = index.span(first, stop)
    part = train.decode_chunks(index, blob[begin:end], first, stop)
    lo, hi = index.values(first, stop)
    assert _bits(part) == _bits(whole[lo:hi])


def test_the_head_alone_says_where_every_chunk_lies():
    blob, _ = encode_delta(_delta(1), None, chunk=CHUNK)
    index = train.read_index(blob, _numel())
    assert index.nchunks == 3 and index.head_size == HEAD + 3 * 8
    assert [index.span(c, c + 1)[1] - index.span(c, c + 1)[0] for c in range(3)] == list(index.lengths)
    assert index.span(0, 3) == (index.head_size, len(blob)) and index.values(2, 3) == (2 * CHUNK, 10000)
    for first, stop in [(0, 0), (2, 1), (-1, 1), (0, 4)]:
        with pytest.raises(ValueError, match="not a run"):
            index.span(first, stop)


def test_bad_chunk_sizes_are_refused_when_encoding():
    for chunk in (1000, 2048, 1 << 25):
        with pytest.raises(ValueError, match="chunk must be a power of two"):
            encode_delta(_delta(0), None, chunk=chunk)
    with pytest.raises(ValueError, match="multiple of the block"):
        encode_delta(_delta(0), None, block=8192, chunk=4096)


def _head(blob: bytes, **fields) -> bytes:
    magic, bits, block, numel, chunk = struct.unpack_from("<4sBIQI", blob)
    values = {"magic": magic, "bits": bits, "block": block, "numel": numel, "chunk": chunk, **fields}
    return struct.pack("<4sBIQI", *values.values()) + blob[HEAD:]


def _set_length(blob: bytes, c: int, length: int) -> bytes:
    return blob[:HEAD + 8 * c] + struct.pack("<Q", length) + blob[HEAD + 8 * (c + 1):]


@pytest.mark.parametrize("mangle,message", [
    (lambda b: b[:20], "shorter than its header"),
    (lambda b: b[:30], "its index needs"),
    (lambda b: _head(b, magic=b"TTD9"), "not a ttpeer delta"),
    (lambda b: _head(b, chunk=3000), "not an allowed size"),
    (lambda b: _head(b, bits=5), "not an allowed combination"),
    (lambda b: _head(b, block=8192), "not an allowed combination"),
    (lambda b: _head(b, numel=9999), "the model has 10000"),
    (lambda b: _set_length(b, 1, 0), "claims 0 compressed bytes"),
    (lambda b: _set_length(b, 1, 1 << 40), "compressed bytes for a"),
    (lambda b: b + b"\0", "its index says"),
    (lambda b: b[:-1], "its index says"),
])
def test_malformed_chunked_deltas_raise_delta_error(mangle, message):
    blob, _ = encode_delta(_delta(2), None, chunk=CHUNK)
    with pytest.raises(DeltaError, match=message):
        decode_delta(mangle(blob), _like())


def test_a_chunk_whose_frame_is_not_its_own_is_refused():
    blob, _ = encode_delta(_delta(3), None, chunk=CHUNK)
    index = train.read_index(blob, _numel())
    (a0, a1), (b0, b1) = index.span(0, 1), index.span(2, 3)
    with pytest.raises(DeltaError, match="declares"):  # the short last chunk's frame where the first's belongs
        train.decode_chunks(index, blob[b0:b1] + blob[a0:a1][len(blob[b0:b1]):], 0, 1)
    with pytest.raises(DeltaError, match="bytes; got"):
        train.decode_chunks(index, blob[a0:a1 - 1], 0, 1)
    with pytest.raises(DeltaError, match="not a chunked ttpeer delta"):
        train.read_index(encode_delta(_delta(3), None)[0], _numel())


@given(st.binary(min_size=0, max_size=200), st.integers(0, 400))
@settings(max_examples=150, deadline=None)
def test_hostile_chunked_bytes_only_ever_raise_delta_error(noise, at):
    blob, _ = encode_delta(_delta(4), None, chunk=CHUNK)
    at = min(at, len(blob))
    mutated = blob[:at] + noise + blob[at + len(noise):]
    try:
        decoded = decode_delta(mutated, _like())
    except DeltaError:
        return
    assert all(bool(torch.isfinite(t).all()) for t in decoded.values())


def _contributions(count: int, shapes=SHAPES) -> list[tuple[dict[str, torch.Tensor], bytes]]:
    out = []
    for k in range(count):
        delta = _delta(10 + k, shapes, scale=1e-2 * (k + 1))
        blob, _ = encode_delta(delta, None, chunk=CHUNK)
        out.append((decode_delta(blob, _like(shapes)), blob))
    return out


def _reduce(contribs, samples, runs, numel=10000) -> list[torch.Tensor]:
    indexes = [train.read_index(blob, numel) for _d, blob in contribs]
    out = []
    for first, stop in runs:
        parts = []
        for index, (_d, blob) in zip(indexes, contribs, strict=True):
            begin, end = index.span(first, stop)
            parts.append((index, blob[begin:end]))
        out.append(train.reduce_slice(parts, samples, first, stop))
    return out


@pytest.mark.parametrize("slices", [1, 2, 3])
def test_slices_reduced_exactly_give_the_outer_step_of_all_deltas_bit_for_bit(slices):
    contribs, samples = _contributions(4), [5, 0, 9, 3]
    g = torch.Generator().manual_seed(7)
    state = OuterState(params={n: torch.randn(s, generator=g) for n, s in SHAPES.items()},
                       momentum={n: torch.randn(s, generator=g) * 0.1 for n, s in SHAPES.items()})
    reduced = _reduce(contribs, samples, slice_chunks(3, slices))
    want = train.outer_step(state, [(d, s) for (d, _b), s in zip(contribs, samples, strict=True)], lr=0.7,
                            momentum=0.9)
    got = train.mean_sum(state, reduced).step(lr=0.7, momentum=0.9)
    for name in SHAPES:
        assert _bits(got.params[name]) == _bits(want.params[name])
        assert _bits(got.momentum[name]) == _bits(want.momentum[name])


@pytest.mark.parametrize("bits", [8, 4, 3])
def test_re_quantized_slices_are_the_blocks_of_the_whole_mean_and_the_same_bytes_everywhere(bits):
    contribs, samples = _contributions(3), [4, 4, 8]
    runs = slice_chunks(3, 2)
    reduced = _reduce(contribs, samples, runs)
    sent = [train.encode_slice(part, bits=bits, block=256) for part in reduced]
    assert sent == [train.encode_slice(part.clone(), bits=bits, block=256)
                    for part in _reduce(contribs, samples, runs)]
    received = torch.cat([train.decode_slice(b, part.numel()) for b, part in zip(sent, reduced, strict=True)])
    whole = torch.cat(reduced)
    once = train.decode_slice(train.encode_slice(whole, bits=bits, block=256), whole.numel())
    assert _bits(received) == _bits(once)
    # Re-quantizing costs at most half a step of each block's absmax (127 steps at 8 bits, 7 at 4, 3 at 3).
    steps = (1 << (bits - 1)) - 1
    assert float((received - whole).abs().max()) <= float(whole.abs().max()) / steps / 2 * (1 + 1e-5)
    with pytest.raises(DeltaError, match="values; the model has"):
        train.decode_slice(sent[0], reduced[0].numel() + 1)


def test_four_bit_slices_are_about_half_the_bytes_of_eight_and_three_bit_fewer_still():
    contribs, samples = _contributions(3), [4, 4, 8]
    (mean,) = _reduce(contribs, samples, [(0, 3)])
    eight, four, three = (len(train.encode_slice(mean, bits=b, block=256)) for b in (8, 4, 3))
    assert four < 0.6 * eight, (four, eight)
    assert three < 0.85 * four, (three, four)  # 3-bit values go as nibbles: zstd takes the unused room


def test_slices_that_do_not_hold_the_model_or_contributions_cut_otherwise_are_refused():
    contribs, samples = _contributions(2), [1, 1]
    reduced = _reduce(contribs, samples, [(0, 3)])[0]
    like = train.template(_like())
    with pytest.raises(DeltaError, match="fewer values"):
        list(train.iter_mean([reduced[:-1]], like))
    with pytest.raises(DeltaError, match="more values"):
        list(train.iter_mean([reduced, reduced[:1]], like))
    other, _ = encode_delta(_delta(5), None, chunk=2 * CHUNK)
    index = train.read_index(other, 10000)
    mine = train.read_index(contribs[0][1], 10000)
    with pytest.raises(DeltaError, match="not cut alike"):
        train.reduce_slice([(mine, contribs[0][1][slice(*mine.span(0, 1))]),
                            (index, other[slice(*index.span(0, 1))])], [1, 1], 0, 1)
    with pytest.raises(ValueError, match="sample counts"):
        train.reduce_slice([(mine, contribs[0][1][slice(*mine.span(0, 1))])], [0], 0, 1)
