"""Pool sealing in pieces (``seal_file``/``open_sealed_file``): states and checkpoints
of any size, one MiB in memory at a time, and no piece may be dropped, reordered,
cut off at the end or moved to another purpose."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from ttpeer.net._seal import PIECE, SALT, TAG, SealError, open_sealed, open_sealed_file, seal, seal_file

KEY, OTHER = os.urandom(32), os.urandom(32)
HEAD = 4 + SALT


@pytest.mark.parametrize("size", [0, 1, PIECE - 1, PIECE, PIECE + 1, 3 * PIECE + 5])
def test_a_sealed_file_opens_to_its_bytes_in_memory_or_file_by_file(tmp_path: Path, size: int) -> None:
    data = os.urandom(size)
    (tmp_path / "plain").write_bytes(data)
    sealed_size = seal_file(KEY, b"blob", tmp_path / "plain", tmp_path / "sealed")
    assert sealed_size == (tmp_path / "sealed").stat().st_size == HEAD + size + max(1, -(-size // PIECE)) * TAG
    open_sealed_file([OTHER, KEY], b"blob", tmp_path / "sealed", tmp_path / "out")  # the second key opens it
    assert (tmp_path / "out").read_bytes() == data
    assert open_sealed(KEY, b"blob", (tmp_path / "sealed").read_bytes()) == data


def test_a_one_piece_blob_opens_from_a_file_too(tmp_path: Path) -> None:
    (tmp_path / "sealed").write_bytes(seal(KEY, b"blob", b"an older blob, sealed whole"))
    open_sealed_file([KEY], b"blob", tmp_path / "sealed", tmp_path / "out")
    assert (tmp_path / "out").read_bytes() == b"an older blob, sealed whole"


def _pieces(tmp_path: Path) -> bytes:
    (tmp_path / "plain").write_bytes(os.urandom(3 * PIECE + 5))
    seal_file(KEY, b"blob", tmp_path / "plain", tmp_path / "sealed")
    return (tmp_path / "sealed").read_bytes()


STEP = PIECE + TAG
TAMPERED = {
    "cut at a piece boundary": lambda d: d[:HEAD + 2 * STEP],
    "last byte gone": lambda d: d[:-1],
    "a middle piece dropped": lambda d: d[:HEAD + STEP] + d[HEAD + 2 * STEP:],
    "two pieces swapped": lambda d: (d[:HEAD] + d[HEAD + STEP:HEAD + 2 * STEP] + d[HEAD:HEAD + STEP]
                                     + d[HEAD + 2 * STEP:]),
    "a bit flipped": lambda d: d[:HEAD + STEP + 7] + bytes([d[HEAD + STEP + 7] ^ 1]) + d[HEAD + STEP + 8:],
    "the salt changed": lambda d: d[:5] + bytes([d[5] ^ 1]) + d[6:],
    "no pieces at all": lambda d: d[:HEAD],
}


@pytest.mark.parametrize("how", sorted(TAMPERED))
def test_a_tampered_sealed_file_is_refused_and_leaves_no_output(tmp_path: Path, how: str) -> None:
    (tmp_path / "bad").write_bytes(TAMPERED[how](_pieces(tmp_path)))
    with pytest.raises(SealError):
        open_sealed_file([KEY], b"blob", tmp_path / "bad", tmp_path / "out")
    assert not (tmp_path / "out").exists()
    with pytest.raises(SealError):
        open_sealed(KEY, b"blob", (tmp_path / "bad").read_bytes())


def test_another_key_or_purpose_does_not_open_it(tmp_path: Path) -> None:
    _pieces(tmp_path)
    for keys, purpose in (([OTHER], b"blob"), ([KEY], b"delta")):
        with pytest.raises(SealError, match="any pool key"):
            open_sealed_file(keys, purpose, tmp_path / "sealed", tmp_path / "out")
        assert not (tmp_path / "out").exists()


def test_a_dataset_piece_seals_to_the_same_blob_every_time_and_opens_to_its_span(tmp_path: Path) -> None:
    """A fixed salt (a dataset piece's, from its hash) and a span of the file: the same key,
    salt and bytes give the same sealed bytes, so a holder can upload a piece again under
    the name its record gives; a random salt gives other bytes."""
    src = tmp_path / "f"
    src.write_bytes(os.urandom(3 * PIECE + 9))
    span, salt = (PIECE, PIECE + 9), b"s" * SALT
    one, two, other = tmp_path / "1", tmp_path / "2", tmp_path / "3"
    seal_file(KEY, b"p", src, one, salt=salt, span=span)
    seal_file(KEY, b"p", src, two, salt=salt, span=span)
    seal_file(KEY, b"p", src, other, span=span)
    assert one.read_bytes() == two.read_bytes() != other.read_bytes()
    open_sealed_file([KEY], b"p", one, tmp_path / "out")
    assert (tmp_path / "out").read_bytes() == src.read_bytes()[PIECE:2 * PIECE + 9]
    with pytest.raises(OSError, match="shrank"):
        seal_file(KEY, b"p", src, one, salt=salt, span=(3 * PIECE, PIECE))  # past the end
