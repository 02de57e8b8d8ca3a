"""The daemon's channel to its workers: bounded, versioned frames, and failures that
travel as kinds the daemon matches (never words), from one table both ends read."""

from __future__ import annotations

import errno
import json
import signal
import struct
from pathlib import Path

import pytest
import torch
import trio
import trio.testing

from ttpeer.daemon.worker._channel import MAX_FRAME, ChannelError, FrameReader, pack, send
from ttpeer.daemon.worker._failures import KINDS, MAX_ITEMS, error, failure
from ttpeer.daemon.worker._workerproc import describe_exit
from ttpeer.errors import DiskError, JobError, LocalWorkLost, StateMissing, TaskFailed, TtpeerError
from ttpeer.proto import DatasetMissing


async def _read_all(data: bytes) -> list[dict]:
    send_stream, recv_stream = trio.testing.memory_stream_one_way_pair()
    await send_stream.send_all(data)
    await send_stream.aclose()
    reader = FrameReader(recv_stream)
    out = []
    while (frame := await reader.read()) is not None:
        out.append(frame)
    return out


async def test_frames_round_trip_in_pieces_and_end_cleanly() -> None:
    send_stream, recv_stream = trio.testing.memory_stream_one_way_pair()
    reader = FrameReader(recv_stream)
    async with trio.open_nursery() as nursery:
        async def writer() -> None:
            for i in range(3):
                data = pack({"id": i, "op": "train", "args": {"x": "y" * 10_000}})
                for k in range(0, len(data), 7):  # torn into small writes
                    await send_stream.send_all(data[k:k + 7])
            await send_stream.aclose()

        nursery.start_soon(writer)
        got = [await reader.read() for _ in range(3)]
        assert await reader.read() is None
    assert [g["id"] for g in got] == [0, 1, 2] and all("v" not in g for g in got)  # checked, then taken off


@pytest.mark.parametrize(("data", "said"), [
    (struct.pack(">I", MAX_FRAME + 1) + b"{}", "announced"),
    (struct.pack(">I", 4) + b"[1]\n", "not a JSON object"),
    (struct.pack(">I", 3) + b"{x}", "not JSON"),
    (struct.pack(">I", 8) + b'{"v":99}', "version 99"),
    (struct.pack(">I", 100) + b"{}", "ended inside a frame"),
    (b"\x00\x00", "inside a frame header"),
])
async def test_a_frame_that_is_not_one_is_refused(data: bytes, said: str) -> None:
    with pytest.raises(ChannelError, match=said):
        await _read_all(data)


async def test_large_values_are_refused_before_they_are_sent() -> None:
    send_stream, _recv = trio.testing.memory_stream_one_way_pair()
    with pytest.raises(ValueError, match="through files"):
        await send(send_stream, {"blob": "x" * MAX_FRAME})


def _round_trip(exc: BaseException) -> Exception:
    return error(json.loads(json.dumps(failure(exc))))


def _moved() -> DatasetMissing:
    missing = DatasetMissing("corpus", dataset="ab" * 32, pieces=[3, 9], whole=False)
    missing.moved = True
    return missing


# One of each kind, with every field it carries set away from its default.
ONE_OF_EACH = {
    "task": TaskFailed("my_task.py:3 in loss: boom"),
    "state_missing": StateMissing("sha256:" + "a" * 64),
    "work_lost": LocalWorkLost("cd" * 32, "the worker process died"),
    "disk": DiskError(Path("/home/x/states/s"), OSError(errno.EROFS, "Read-only file system")),
    "dataset": _moved(),
    "job": JobError("no such state"),
    "error": TtpeerError("a ttpeer error of no narrower kind"),
}


def test_every_kind_of_the_table_has_an_example_here() -> None:
    assert set(ONE_OF_EACH) == set(KINDS)


@pytest.mark.parametrize("kind", sorted(ONE_OF_EACH))
def test_every_kind_crosses_and_comes_back_as_the_same_error(kind: str) -> None:
    sent = ONE_OF_EACH[kind]
    assert failure(sent)["error"] == kind
    back = _round_trip(sent)
    assert type(back) is type(sent) and str(back) == str(sent)
    for name in KINDS[kind][1]:
        assert getattr(back, name) == getattr(sent, name), name


def test_a_peers_malformed_delta_is_retried_by_the_protocol_as_in_process_not_the_tasks_failure() -> None:
    # ``in_thread`` lets train.DeltaError pass (the protocol tries again): across the
    # channel it must not become TaskFailed, which would end the job on this peer.
    from ttpeer import train

    back = _round_trip(train.DeltaError("delta is cut short: chunks [0, 4) need 96 bytes"))
    assert not isinstance(back, TaskFailed) and isinstance(back, TtpeerError)
    assert str(back) == "delta is cut short: chunks [0, 4) need 96 bytes"


def test_an_error_outside_the_table_is_the_tasks_failure_with_its_type_and_message() -> None:
    try:
        {}["weights"]
    except KeyError as exc:
        frame = failure(exc)
    assert frame["error"] == "task"
    assert frame["message"].startswith("KeyError: 'weights' (at test_worker_channel.py:")
    back = _round_trip(KeyError("weights"))
    assert type(back) is TaskFailed and back.reason == "KeyError: 'weights'"


def test_the_workers_own_os_errors_are_the_disks_or_the_steps() -> None:
    full = failure(OSError(errno.ENOSPC, "No space left on device", "/home/x/work/d.bin"))
    assert full["error"] == "disk" and full["path"] == "/home/x/work/d.bin"
    assert full["message"] == ("could not write /home/x/work/d.bin: No space left on device (the disk is full: "
                               "free some space and run again)")
    gone = failure(FileNotFoundError(errno.ENOENT, "No such file or directory", "/home/x/work/d.bin"))
    assert gone == {"error": "job", "message": "/home/x/work/d.bin: No such file or directory"}


def test_a_long_list_of_missing_pieces_crosses_cut_short() -> None:
    frame = failure(DatasetMissing("corpus", dataset="ab" * 32, pieces=list(range(MAX_ITEMS + 10))))
    assert len(frame["pieces"]) == MAX_ITEMS and len(pack({"id": 1, **frame})) < MAX_FRAME


@pytest.mark.parametrize("frame", [
    {"error": "no_such_kind", "message": "it broke"},
    {"error": "state_missing", "message": "state gone"},  # its field is missing
    {"error": "dataset", "message": "x", "name": "c", "dataset": "", "pieces": ["1"], "whole": True, "moved": False},
    {"error": "task", "message": None},
    {"error": None},
])
def test_a_failure_that_is_not_one_is_a_job_error_not_a_crash(frame: dict) -> None:
    assert type(error(frame)) is JobError


def test_cuda_running_out_of_memory_says_which_device_and_what_to_do() -> None:
    oom = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 64.00 TiB. GPU 1 has a total capacity "
                                 "of 79.19 GiB of which 70.00 GiB is free.")
    for exc in (oom, _wrapped(oom)):
        message = failure(exc)
        assert message["error"] == "task"
        assert message["message"].startswith("out of GPU memory on cuda:1: try a smaller --micro-batch / --batch-size")


def _wrapped(inner: BaseException) -> BaseException:
    try:
        try:
            raise inner
        except Exception as exc:
            raise TaskFailed("loss raised") from exc
    except TaskFailed as outer:
        return outer


def test_how_a_worker_ended_is_said_by_signal_or_code() -> None:
    assert describe_exit(-signal.SIGSEGV) == "it was killed by SIGSEGV"
    assert "out-of-memory killer" in describe_exit(-signal.SIGKILL)
    assert describe_exit(3) == "it exited with code 3"


def test_a_failure_wrapped_by_a_nursery_is_sent_as_itself() -> None:
    wrapped = BaseExceptionGroup("Exceptions from Trio nursery", [TaskFailed("boom_task.py:31 in loss: boom")])
    assert failure(wrapped) == {"error": "task", "message": "boom_task.py:31 in loss: boom",
                                "reason": "boom_task.py:31 in loss: boom"}
