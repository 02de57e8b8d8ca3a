"""The messages of the daemon's two local channels (its workers, the control socket): one
codec, every request and reply type crossing and coming back equal, each request with one
handler, and a malformed message refused with words that name what is wrong, never a
crash of the daemon."""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from pathlib import Path
from typing import Any

import pytest
import trio

from ttpeer.daemon import call, control
from ttpeer.daemon._codec import Codec, Message, MessageError, reply_type
from ttpeer.daemon._executor import Decline
from ttpeer.daemon.service._control import _HANDLERS as CONTROL_HANDLERS
from ttpeer.daemon.service._control import serve_control
from ttpeer.daemon.worker import _workermsg as msg
from ttpeer.daemon.worker._worker import _HANDLERS as WORKER_HANDLERS
from ttpeer.proto import JobSpec, Outer, Record, sign

from .proto_helpers import Pool, job_body, key

JOB = sign("job", Pool("messages").id, job_body(), key("messages-author"))
SPEC = JobSpec.of(JOB)
CODECS = {"worker": msg.CODEC, "control": control.CODEC}


def sample(hint: Any) -> Any:
    """A value of type ``hint``, away from every default (a union: its first arm)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is typing.Union or origin is types.UnionType:
        return sample(args[0])
    if hint is Any or origin is dict:
        return {"loss": 0.25, "nested": [1, "two", None]}
    if origin is list:
        return [sample(args[0]), sample(args[0])]
    if origin is tuple:
        return tuple(sample(a) for a in (args[:1] * 2 if args[-1] is Ellipsis else args))
    if hint is Record:
        return JOB
    if hint is JobSpec:
        return SPEC
    if hint is Outer:
        return Outer(0.7, 0.9)
    if dataclasses.is_dataclass(hint):
        hints = typing.get_type_hints(hint)
        return hint(**{f.name: sample(hints[f.name]) for f in dataclasses.fields(hint)})  # type: ignore[operator]
    return {str: "text", int: 7, float: 0.5, bool: True, bytes: b"\x00task", Path: Path("/home/x/work/f.bin"),
            type(None): None}[hint]


def _wire(obj: Any) -> Any:
    return json.loads(json.dumps(obj))


@pytest.mark.parametrize(("name", "cls"), [(name, cls) for name, codec in CODECS.items()
                                           for cls in codec.types.values()])
def test_every_message_and_its_reply_cross_and_come_back_equal(name: str, cls: type[Message[Any]]) -> None:
    codec = CODECS[name]
    sent = sample(cls)
    assert codec.decode(_wire(codec.encode(sent))) == sent
    reply = sample(reply_type(cls))
    assert codec.reply(sent, _wire(codec.to_json(reply))) == reply


def test_a_train_request_carries_the_machines_effect_as_it_is() -> None:
    from ttpeer import proto

    eff = proto.Train(SPEC, 2, 1, 0, "sha256:" + "b" * 64, True, inner_steps=None, first_step=40, ahead=None)
    frame = _wire(msg.CODEC.encode(msg.Train(eff)))
    assert frame["eff"]["job"] == JOB.raw.hex() and frame["eff"]["first_step"] == 40
    assert msg.CODEC.decode(frame) == msg.Train(eff)


def test_every_request_has_one_handler() -> None:
    assert set(WORKER_HANDLERS) == set(msg.REQUESTS)
    assert set(CONTROL_HANDLERS) == set(control.CODEC.types.values())


def test_a_decline_or_its_reason_comes_back_as_it_was_sent() -> None:
    prepare = msg.Prepare(SPEC, None)
    for decline in (Decline("needs 12 GiB", need=12, have=8, code="fit"), "a reason", None):
        assert msg.CODEC.reply(prepare, _wire(msg.CODEC.to_json(decline))) == decline


@pytest.mark.parametrize(("frame", "said"), [
    ({"op": "launch"}, "unknown op 'launch'"),
    ({"spec": {}}, "unknown op None"),
    ({"op": "cancel"}, "cancel: missing field 'job'"),
    ({"op": "cancel", "job": "ab", "why": "x"}, "cancel: unknown field 'why'"),
    ({"op": "cancel", "job": 12}, "cancel.job: 12 is not a str"),
    ({"op": "submit", "spec": [], "task_file": None}, "submit.spec: [] is not a dict"),
    ({"op": "submit", "spec": {}, "task_file": "zz"}, "submit.task_file: 'zz' is none of bytes | null"),
    ({"op": "data_add", "path": "/d", "urls": ["https://a", 3]}, "data_add.urls: ['https://a', 3] is none of"),
    ({"op": "data_rm", "dataset": "c", "withdraw": 1}, "data_rm.withdraw: 1 is not a bool"),
])
def test_a_malformed_control_request_is_refused_naming_what_is_wrong(frame: dict[str, Any], said: str) -> None:
    with pytest.raises(MessageError) as err:
        control.CODEC.decode(frame)
    assert str(err.value).startswith(said)


@pytest.mark.parametrize(("frame", "said"), [
    ({"op": "prepare", "job": "00ff", "task_file": None}, "prepare.job: not a record"),
    ({"op": "prepare", "job": 5, "task_file": None}, "prepare.job: "),
    ({"op": "prepare", "job": sign("cancel", Pool("messages").id, {"job": "ab" * 32, "at": 1}, key("messages-author"))
      .raw.hex(), "task_file": None}, "prepare.job: a cancel record is not a job"),
    ({"op": "train", "eff": {"job": JOB.raw.hex(), "round": 1}}, "train.eff: missing field 'shard'"),
    ({"op": "aggregate", "job": JOB.raw.hex(), "base": "s", "deltas": [["/d", 3, 4]], "round": 1},
     "aggregate.deltas[0]: 3 items where 2 go"),
    ({"op": "apply", "job": JOB.raw.hex(), "base": "s", "deltas": [], "expect": "e", "round": 1,
      "outer": [0.7, "x"]}, "apply.outer: [0.7, 'x'] is none of Outer | null"),
])
def test_a_malformed_worker_message_is_refused_naming_what_is_wrong(frame: dict[str, Any], said: str) -> None:
    with pytest.raises(MessageError) as err:
        msg.CODEC.decode(frame)
    assert str(err.value).startswith(said)


def test_a_reply_of_another_type_is_refused() -> None:
    with pytest.raises(MessageError, match="the reply to delta: missing field 'metrics'"):
        msg.CODEC.reply(msg.Delta(sample(msg.Delta).eff, Path("/d")), {"file": "/d"})
    with pytest.raises(MessageError, match="the reply to train: 'many' is not a int"):
        msg.CODEC.reply(sample(msg.Train), "many")


def test_a_codec_refuses_to_send_what_is_not_its_own() -> None:
    with pytest.raises(MessageError, match="not a message of this channel"):
        control.CODEC.encode(msg.Warm())
    with pytest.raises(ValueError, match="two messages named 'status'"):
        Codec((control.Status, control.Status))


async def test_the_control_socket_answers_a_malformed_request_and_keeps_serving(tmp_path: Path) -> None:
    path = tmp_path / "control.sock"

    def raw(data: bytes) -> dict[str, Any]:
        import socket

        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.connect(str(path))
            s.sendall(data)
            s.shutdown(socket.SHUT_WR)
            return dict(json.loads(s.makefile("rb").read()))

    async with trio.open_nursery() as nursery:
        node: Any = None  # a request that decodes wrong never reaches the node
        await nursery.start(lambda task_status: serve_control(node, path, status=lambda: {"peers": 2},
                                                              task_status=task_status))
        for data, said in [(b"[1, 2]", "bad control request: a request is one JSON object"),
                           (b"{not json", "bad control request: "),
                           (b'{"op": "nope"}', "bad control request: unknown op 'nope'"),
                           (b'{"op": "cancel", "job": 3}', "bad control request: cancel.job: 3 is not a str"),
                           (b"[" * 100_000, "bad control request: ")]:  # past the JSON parser's depth
            reply = await trio.to_thread.run_sync(raw, data)
            assert reply["ok"] is False and reply["error"].startswith(said), reply
        assert await trio.to_thread.run_sync(call, path, {"op": "status"}) == {"ok": True, "status": {"peers": 2}}
        from ttpeer.daemon import ask

        assert (await trio.to_thread.run_sync(ask, path, control.Status())).status == {"peers": 2}
        nursery.cancel_scope.cancel()


def test_a_job_crosses_only_as_its_records_own_spec() -> None:
    """A spec made with ``replace`` would arrive as its record's: the sender refuses it."""
    from ttpeer import proto

    sized = dataclasses.replace(SPEC, inner_steps=SPEC.inner_steps + 1)
    with pytest.raises(ValueError, match="differs from its record"):
        msg.CODEC.encode(msg.Train(proto.Train(sized, 0, 0, 0, "sha256:" + "b" * 64, True)))
