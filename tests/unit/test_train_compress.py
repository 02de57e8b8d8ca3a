"""Delta compression: bounded error, error feedback, and hostile bytes refused."""

import resource
import struct

import pytest
import torch
import zstandard
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ttpeer.train import DeltaError, Diverged, OuterState, decode_delta, encode_delta, fp32_size

torch.set_num_threads(1)

SHAPES = {"layer.weight": (33, 17), "layer.bias": (33,), "out.weight": (5, 33)}


def _like(shapes=SHAPES) -> OuterState:
    params = {name: torch.zeros(shape) for name, shape in shapes.items()}
    return OuterState(params=params, momentum={k: v.clone() for k, v in params.items()})


def _random_delta(seed: int, shapes=SHAPES, scale: float = 1e-2) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {name: torch.randn(shape, generator=gen) * scale for name, shape in shapes.items()}


def _flat(tensors):
    return torch.cat([tensors[name].reshape(-1) for name in sorted(tensors)])


def _block_scales(flat, block, qmax):
    padded = torch.cat([flat, flat.new_zeros(-flat.numel() % block)])
    return padded.view(-1, block).abs().amax(dim=1) / qmax


@pytest.mark.parametrize("bits,block", [(8, 256), (8, 16), (4, 64), (4, 256), (3, 256)])
def test_round_trip_error_is_at_most_half_a_step(bits, block):
    delta = _random_delta(0)
    data, residual = encode_delta(delta, None, bits=bits, block=block)
    decoded = decode_delta(data, _like())
    assert list(decoded) == list(SHAPES) and all(decoded[n].shape == SHAPES[n] for n in SHAPES)
    flat_in = _flat(delta)
    error = (flat_in - _flat(decoded)).abs()
    scales = _block_scales(flat_in, block, (1 << (bits - 1)) - 1)
    bound = torch.repeat_interleave(scales, block)[:flat_in.numel()] / 2
    assert bool((error <= bound * (1 + 1e-5) + 1e-12).all())
    # The residual is exactly what the receiver did not get.
    assert torch.equal(_flat(residual), flat_in - _flat(decoded))


def test_decoding_is_bit_identical_and_deterministic():
    data, _ = encode_delta(_random_delta(1), None)
    first, second = decode_delta(data, _like()), decode_delta(data, _like())
    assert all(torch.equal(first[n], second[n]) for n in first)


def test_zero_delta_round_trips_exactly():
    delta = {name: torch.zeros(shape) for name, shape in SHAPES.items()}
    data, residual = encode_delta(delta, None, bits=4)
    assert all(torch.equal(t, torch.zeros_like(t)) for t in decode_delta(data, _like()).values())
    assert all(torch.equal(t, torch.zeros_like(t)) for t in residual.values())


def test_error_feedback_keeps_the_running_sum_on_track():
    # One large value per block forces a coarse step; the small steady drift of
    # the other values is below half a step, so without feedback it is lost.
    def delta_for(round_):
        d = _random_delta(100 + round_, scale=1e-4)
        d["layer.weight"][0, 0] = 1.0
        d["layer.weight"] += 2e-2
        return d

    true_sum = {n: torch.zeros(s) for n, s in SHAPES.items()}
    with_fb = {n: torch.zeros(s) for n, s in SHAPES.items()}
    without_fb = {n: torch.zeros(s) for n, s in SHAPES.items()}
    residual = None
    for round_ in range(20):
        delta = delta_for(round_)
        data, residual = encode_delta(delta, residual, bits=4, block=256)
        plain, _ = encode_delta(delta, None, bits=4, block=256)
        for name in SHAPES:
            true_sum[name] += delta[name]
            with_fb[name] += decode_delta(data, _like())[name]
            without_fb[name] += decode_delta(plain, _like())[name]
        # The residual stays within half a quantization step (about 1/7 here).
        assert max(t.abs().max().item() for t in residual.values()) <= 0.5 * 1.1 / 7
    drift_fb = (_flat(true_sum) - _flat(with_fb)).abs().max().item()
    drift_plain = (_flat(true_sum) - _flat(without_fb)).abs().max().item()
    assert drift_fb <= 0.5 * 1.1 / 7  # one residual, not 20 rounds of error
    assert drift_plain > 0.3  # 20 rounds x 0.02 lost without feedback
    assert torch.allclose(_flat(true_sum) - _flat(with_fb), _flat(residual), atol=1e-5)


def test_int8_compresses_more_than_3_5x():
    shapes = {"big": (256, 512), "small": (1000,)}
    delta = _random_delta(2, shapes)
    data, _ = encode_delta(delta, None, bits=8)
    assert fp32_size(delta) / len(data) > 3.5
    assert fp32_size(_like(shapes)) == fp32_size(delta)


def test_encode_refuses_non_finite_and_bad_arguments():
    delta = _random_delta(3)
    delta["layer.bias"][4] = float("nan")
    with pytest.raises(Diverged, match="NaN or inf"):
        encode_delta(delta, None)
    with pytest.raises(ValueError):
        encode_delta(_random_delta(3), None, bits=2)
    with pytest.raises(ValueError):
        encode_delta(_random_delta(3), None, block=100)
    with pytest.raises(ValueError):
        encode_delta(_random_delta(3), {"layer.bias": torch.zeros(33)})


def _header(bits=8, block=256, numel=None):
    numel = sum(torch.Size(s).numel() for s in SHAPES.values()) if numel is None else numel
    return struct.pack("<4sBIQ", b"TTD1", bits, block, numel)


@pytest.mark.parametrize("mangle,message", [
    (lambda d: d[:10], "shorter than"),
    (lambda d: b"XXXX" + d[4:], "bad magic"),
    (lambda d: d[:4] + bytes([5]) + d[5:], "bits=5"),
    (lambda d: _header(block=100) + d[17:], "block=100"),
    (lambda d: _header(numel=7) + d[17:], "7 values"),
    (lambda d: d + b"\0", "unused data|does not decompress"),
    (lambda d: d[:-3], "does not decompress|not a zstd frame"),
])
def test_malformed_deltas_raise_delta_error(mangle, message):
    data, _ = encode_delta(_random_delta(4), None)
    with pytest.raises(DeltaError, match=message):
        decode_delta(mangle(data), _like())


def test_out_of_range_values_and_bad_scales_are_refused():
    numel = sum(torch.Size(s).numel() for s in SHAPES.values())
    nblocks = -(-numel // 256)

    def wire(scales, values):
        payload = struct.pack(f"<{nblocks}f", *scales) + values
        return _header() + zstandard.ZstdCompressor().compress(payload)

    ok = wire([0.5] * nblocks, b"\x01" * numel)
    assert decode_delta(ok, _like())["layer.bias"][0].item() == 0.5
    with pytest.raises(DeltaError, match="-128"):
        decode_delta(wire([0.5] * nblocks, b"\x80" * numel), _like())
    with pytest.raises(DeltaError, match="scale"):
        decode_delta(wire([float("nan")] * nblocks, b"\x01" * numel), _like())
    with pytest.raises(DeltaError, match="scale"):
        decode_delta(wire([-1.0] * nblocks, b"\x01" * numel), _like())
    with pytest.raises(DeltaError, match="non-finite"):
        decode_delta(wire([3e38] * nblocks, b"\x7f" * numel), _like())


@pytest.mark.parametrize(("bits", "nibble", "ok"), [(4, 7, True), (4, 9, True), (4, 8, False), (3, 3, True),
                                                    (3, 13, True), (3, 4, False), (3, 12, False), (3, 8, False)])
def test_a_nibble_outside_its_width_is_refused(bits, nibble, ok):
    # Nibbles are two's complement: 13 is -3, 12 is -4; 3 bits hold [-3, 3], 4 bits [-7, 7].
    numel = sum(torch.Size(s).numel() for s in SHAPES.values())
    nblocks = -(-numel // 256)
    values = bytes([nibble | nibble << 4]) * (numel // 2) + (bytes([nibble]) if numel % 2 else b"")
    data = _header(bits=bits) + zstandard.ZstdCompressor().compress(struct.pack(f"<{nblocks}f", *[0.5] * nblocks)
                                                                     + values)
    if ok:
        value = decode_delta(data, _like())["layer.bias"][0].item()
        assert value == 0.5 * (nibble - 16 if nibble >= 8 else nibble)
    else:
        with pytest.raises(DeltaError, match=f"{bits}-bit value outside"):
            decode_delta(data, _like())


def test_decompression_bombs_are_refused_without_inflating():
    shapes = {"w": (1000, 100)}  # a ~100 kB payload, so a 2 kB frame is plausible in size
    header = _header(numel=100_000)
    huge = b"\0" * (64 << 20)
    declared = zstandard.ZstdCompressor(write_content_size=True).compress(huge)
    stream = zstandard.ZstdCompressor().compressobj()
    undeclared = stream.compress(huge) + stream.flush()
    del huge
    assert len(declared) < 10_000 and len(undeclared) < 10_000
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    for frame in (declared, undeclared):
        with pytest.raises(DeltaError, match="declares"):
            decode_delta(header + frame, _like(shapes))
    grown_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    assert grown_kib < 32 * 1024


def _valid_wire() -> bytes:
    return encode_delta(_random_delta(5), None, bits=4, block=64)[0]


hostile = st.one_of(
    st.binary(max_size=2000),
    st.binary(max_size=4000).map(lambda tail: _header(bits=4, block=64) + tail),
    st.tuples(st.lists(st.tuples(st.integers(0, 10_000), st.integers(1, 255)), max_size=8),
              st.integers(0, 10_000)).map(
        lambda edits: _mutate(_valid_wire(), *edits)),
    # Well-formed frames of exactly the expected payload size (12 scales + 380
    # bytes of nibbles) reach the scale and value checks.
    st.binary(min_size=428, max_size=428).map(
        lambda payload: _header(bits=4, block=64) + zstandard.ZstdCompressor().compress(payload)),
)


def _mutate(data: bytes, flips, cut) -> bytes:
    buf = bytearray(data)
    for position, xor in flips:
        buf[position % len(buf)] ^= xor
    return bytes(buf[:max(cut, 1)]) if cut < len(buf) else bytes(buf)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=hostile)
def test_hostile_bytes_only_ever_raise_delta_error(data):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    try:
        decoded = decode_delta(data, _like())
    except DeltaError:
        pass
    else:
        assert all(bool(torch.isfinite(t).all()) for t in decoded.values())
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 64 * 1024
