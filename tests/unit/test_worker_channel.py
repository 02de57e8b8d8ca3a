"""The daemon's channel to its workers: bounded, versioned frames, and failures that
travel as kinds the daemon matches (never words)."""

from __future__ import annotations

import json
import signal
import struct

import pytest
import torch
import trio
import trio.testing

from ttpeer.daemon._channel import MAX_FRAME, VERSION, ChannelError, FrameReader, pack, send
from ttpeer.daemon._worker import failure
from ttpeer.daemon._workerproc import _error, describe_exit
from ttpeer.errors import DiskError, JobError, StateMissing, TaskFailed


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
    assert [g["id"] for g in got] == [0, 1, 2] and all(g["v"] == VERSION for g in got)


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


def test_failures_cross_as_kinds_and_come_back_as_the_same_errors() -> None:
    def round_trip(exc: BaseException) -> Exception:
        return _error(json.loads(json.dumps(failure(exc))))

    assert isinstance(round_trip(TaskFailed("my_task.py:3 in loss: boom")), TaskFailed)
    back = round_trip(StateMissing("sha256:" + "a" * 64))
    assert isinstance(back, StateMissing) and back.state == "sha256:" + "a" * 64
    assert isinstance(round_trip(DiskError(__import__("pathlib").Path("/x"), OSError(28, "full"))), DiskError)
    assert type(round_trip(JobError("no such state"))) is JobError
    # Anything outside the tree is still the task's failure here, never the daemon's.
    odd = round_trip(KeyError("weights"))
    assert isinstance(odd, TaskFailed) and "KeyError" in str(odd)


def test_cuda_running_out_of_memory_says_which_device_and_what_to_do() -> None:
    oom = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 64.00 TiB. GPU 1 has a total capacity "
                                 "of 79.19 GiB of which 70.00 GiB is free.")
    for exc in (oom, _wrapped(oom)):
        message = failure(exc)
        assert message["error"] == "oom"
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
    assert failure(wrapped) == {"error": "task", "message": "boom_task.py:31 in loss: boom"}
