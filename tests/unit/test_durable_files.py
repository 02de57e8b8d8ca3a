"""The start-up check finds damaged files, reports them and never lets the daemon use
them; the record log survives a disk that fills up mid-append."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import time
import zlib

import pytest
import torch

from ttpeer import train
from ttpeer.daemon import Home
from ttpeer.daemon.node._recordlog import _HEAD, RecordLog
from ttpeer.daemon.service._integrity import check_home, scan_log
from ttpeer.errors import DiskError

RELAY, FP = "https://127.0.0.1:1", "sha256:" + "ab" * 32


def _frame(body: bytes) -> bytes:
    return _HEAD.pack(len(body), zlib.crc32(body)) + body


def _state(seed: int) -> train.OuterState:
    gen = torch.Generator().manual_seed(seed)
    params = {"w": torch.randn(16, 8, generator=gen), "b": torch.randn(8, generator=gen)}
    return train.OuterState(params=params, momentum={k: torch.zeros_like(v) for k, v in params.items()})


def _home(tmp_path) -> Home:
    home = Home(tmp_path / "h")
    home.create_pool(RELAY, FP, "alice", time.time())
    return home


def test_scan_tells_a_torn_tail_from_corruption():
    frames = [_frame(b"record-%d" % i) for i in range(5)]
    whole = b"".join(frames)
    assert scan_log(whole).problem is None and len(scan_log(whole).frames) == 5
    torn = scan_log(whole[:-3])
    assert torn.problem == "torn" and len(torn.frames) == 4 and torn.good_end == len(b"".join(frames[:4]))
    flipped = bytearray(whole)
    flipped[len(frames[0]) + 10] ^= 0x01
    bad = scan_log(bytes(flipped))
    assert bad.problem.startswith("corrupt: checksum") and len(bad.frames) == 1
    huge = whole[: len(frames[0])] + b"\xff\xff\xff\xff" + whole[len(frames[0]) + 4 :]
    assert scan_log(huge).problem.startswith("corrupt: a frame length")


def test_check_home_quarantines_what_is_damaged_and_keeps_what_is_whole(tmp_path, caplog):
    home = _home(tmp_path)
    job = "ab" * 32
    folder = home.states(job)
    digests = []
    for seed in (1, 2, 3):
        st = _state(seed)
        digest = train.state_hash(st)
        (folder / f"{digest.removeprefix('sha256:')}.state").write_bytes(train.state_to_bytes(st))
        digests.append(digest.removeprefix("sha256:"))
    bad = folder / f"{digests[1]}.state"
    data = bytearray(bad.read_bytes())
    data[-5] ^= 0x40  # one bit in the momentum: decodes fine, hashes wrong
    bad.write_bytes(bytes(data))
    cut = folder / f"{digests[2]}.state"
    cut.write_bytes(cut.read_bytes()[:100])  # a copy cut short: does not decode
    (folder / ".x.state.tmp123").write_bytes(b"partial")  # a write a crash interrupted
    model = folder / "final.safetensors"
    model.write_bytes(b"model bytes")
    (folder / "final.json").write_text(json.dumps({"model_sha256": hashlib.sha256(b"other").hexdigest()}))
    frames = b"".join(_frame(b"r%d" % i) for i in range(10))
    corrupt = bytearray(frames)
    corrupt[40] ^= 0xFF
    home.records_log.write_bytes(bytes(corrupt))

    found = check_home(home)

    assert len(found) == 4, found
    assert {p.name for p in folder.iterdir()} == {f"{digests[0]}.state"}
    quarantined = sorted(p.name.split(".")[0] for p in (home.path / "quarantine" / job).iterdir())
    assert quarantined == sorted([digests[1], digests[2], "final", "final"])
    kept = scan_log(home.records_log.read_bytes())
    assert kept.problem is None and 0 < len(kept.frames) < 10
    damaged = list(home.path.glob("records.log.damaged-*"))
    assert len(damaged) == 1 and kept.good_end + damaged[0].stat().st_size == len(frames)
    assert all(r.levelname == "ERROR" for r in caplog.records if "corrupt" in r.message)
    assert check_home(home) == []  # repaired: a second start finds nothing


def test_a_torn_tail_is_cut_and_reported_as_a_crash(tmp_path):
    home = _home(tmp_path)
    whole = b"".join(_frame(b"r%d" % i) for i in range(3))
    home.records_log.write_bytes(whole + _frame(b"last")[:-2])
    found = check_home(home)
    assert len(found) == 1 and "torn frame" in found[0]
    assert home.records_log.read_bytes() == whole and not list(home.path.glob("records.log.damaged-*"))


@pytest.mark.slow
@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a small tmpfs needs root")
def test_a_full_disk_mid_append_keeps_every_record_written(tmp_path):
    mnt = tmp_path / "disk"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mnt)]).returncode != 0:
        pytest.skip("cannot mount a tmpfs here")
    try:
        log = RecordLog(mnt / "records.log")
        written = []
        with pytest.raises(DiskError, match="the disk is full"):
            for i in range(100_000):
                body = b"record %06d " % i + b"x" * (97 + i % 50)  # frames of changing size
                log.append(body)
                written.append(body)
        log.close()
        assert len(written) > 100
        again = RecordLog(mnt / "records.log").load()
        assert again == written  # every acknowledged append is whole, nothing after it
        assert scan_log((mnt / "records.log").read_bytes()).problem is None
    finally:
        subprocess.run(["umount", str(mnt)], check=False)


def test_a_kept_copy_of_an_own_delta_is_used_only_while_it_hashes_as_uploaded(tmp_path):
    import hashlib

    from ttpeer.daemon.sealed._owncopies import _copy_own

    own = tmp_path / "own.bin"
    own.write_bytes(b"delta bytes" * 100)
    digest = hashlib.sha256(own.read_bytes()).hexdigest()
    assert _copy_own(own, digest, tmp_path / "a.bin", 1100) and (tmp_path / "a.bin").read_bytes() == own.read_bytes()
    assert not _copy_own(own, digest, tmp_path / "b.bin", 1101)  # not the contribution's size
    own.write_bytes(b"Delta bytes" * 100)  # the disk changed it: the blob is downloaded instead
    assert not _copy_own(own, digest, tmp_path / "c.bin", 1100) and not (tmp_path / "c.bin").exists()
    own.unlink()
    assert not _copy_own(own, digest, tmp_path / "d.bin", 1100)
