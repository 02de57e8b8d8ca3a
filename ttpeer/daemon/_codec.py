"""One codec for the messages of the daemon's two local channels: its worker processes
(``_workermsg``) and the control socket (``control``).

A message is a frozen dataclass that names its ``op`` and the type of its reply (it
derives from ``Message[Reply]``); on the wire it is one JSON object, ``{"op": op,
**fields}``, and a reply is its value as JSON. Values are written by what they are: a
dataclass as an object of its fields (so an effect such as ``Train`` crosses as itself,
its fields written once, in ``proto``), a tuple or NamedTuple as a list, bytes as hex, a
path as a string, and a type the codec is given a pair of functions for (a ``Record``:
its bytes in hex) through them. They are read back by the annotations: every field is
checked against its type, and anything else (an unknown op, a field missing, unknown or
of another type) raises ``MessageError`` naming the field, so a malformed message is
refused whole, never half-read.

No trio, torch or protocol here: the client commands import it.
"""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any, ClassVar, Generic, TypeVar

R = TypeVar("R")


class MessageError(ValueError):
    """A message that is not one of the codec's, or whose fields do not have their types."""


class Message(Generic[R]):
    """A request whose reply is an ``R``. Subclasses are frozen dataclasses that set ``op``."""

    op: ClassVar[str]


# How a foreign type crosses: (to JSON, from JSON); the second raises ValueError or TypeError.
Convert = tuple[Callable[[Any], Any], Callable[[Any], Any]]


class Codec:
    def __init__(self, messages: Iterable[type[Message[Any]]], convert: Mapping[type, Convert] | None = None) -> None:
        self.types: dict[str, type[Message[Any]]] = {}
        for cls in messages:
            if cls.op in self.types:
                raise ValueError(f"two messages named {cls.op!r}")
            self.types[cls.op] = cls
        self._convert = dict(convert or {})

    def encode(self, msg: Message[Any]) -> dict[str, Any]:
        if self.types.get(msg.op) is not type(msg):
            raise MessageError(f"{type(msg).__name__} is not a message of this channel")
        return {"op": msg.op, **self.to_json(msg)}

    def decode(self, obj: Mapping[str, Any]) -> Message[Any]:
        """The message ``obj`` is. Raises ``MessageError``."""
        op = obj.get("op")
        cls = self.types.get(op) if isinstance(op, str) else None
        if cls is None:
            raise MessageError(f"unknown op {op!r}")
        return typing.cast(Message[Any], self.value(cls, {k: v for k, v in obj.items() if k != "op"}, cls.op))

    def reply(self, request: Message[R], raw: Any) -> R:
        """The reply to ``request`` that ``raw`` is. Raises ``MessageError``."""
        return typing.cast(R, self.value(reply_type(type(request)), raw, f"the reply to {request.op}"))

    def to_json(self, value: Any) -> Any:
        """``value`` as JSON values (a dataclass: an object of its fields)."""
        convert = self._convert.get(type(value))
        if convert is not None:
            return convert[0](value)
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            return {f.name: self.to_json(getattr(value, f.name)) for f in dataclasses.fields(value)}
        if isinstance(value, list | tuple):
            return [self.to_json(v) for v in value]
        if isinstance(value, dict):
            return {k: self.to_json(v) for k, v in value.items()}
        if isinstance(value, bytes):
            return value.hex()
        if isinstance(value, Path):
            return str(value)
        return value

    def value(self, hint: Any, raw: Any, where: str) -> Any:
        """``raw`` read as a ``hint``. Raises ``MessageError`` saying ``where`` it is wrong."""
        if hint is Any:
            return raw
        if hint is None or hint is type(None):
            if raw is None:
                return None
            raise MessageError(f"{where}: {_shown(raw)} is not null")
        origin, args = typing.get_origin(hint), typing.get_args(hint)
        if origin is typing.Union or origin is types.UnionType:
            for arm in args:
                try:
                    return self.value(arm, raw, where)
                except MessageError:
                    continue
            raise MessageError(f"{where}: {_shown(raw)} is none of {' | '.join(map(_name, args))}")
        if hint in self._convert:
            try:
                return self._convert[hint][1](raw)
            except (ValueError, TypeError) as exc:
                raise MessageError(f"{where}: {exc}") from None
        if origin is list and type(raw) is list:
            return [self.value(args[0], v, f"{where}[{i}]") for i, v in enumerate(raw)]
        if origin is tuple and type(raw) is list:
            return tuple(self._items([args[0]] * len(raw) if args[-1:] == (Ellipsis,) else args, raw, where))
        if origin is dict and type(raw) is dict and all(type(k) is str for k in raw):
            return {k: self.value(args[1], v, f"{where}.{k}") for k, v in raw.items()}
        if isinstance(hint, type):
            return self._plain(hint, raw, where)
        raise MessageError(f"{where}: {_shown(raw)} is not a {_name(hint)}")

    def _plain(self, cls: type, raw: Any, where: str) -> Any:
        if cls in (str, int, bool) and type(raw) is cls:
            return raw
        if cls is float and type(raw) in (int, float):
            return raw
        if cls is bytes and type(raw) is str:
            try:
                return bytes.fromhex(raw)
            except ValueError:
                raise MessageError(f"{where}: not hex") from None
        if cls is Path and type(raw) is str:
            return Path(raw)
        if dataclasses.is_dataclass(cls) and type(raw) is dict:
            hints = _fields(cls)
            unknown = set(raw) - set(hints)
            if unknown:
                raise MessageError(f"{where}: unknown field {sorted(unknown)[0]!r}")
            missing = [name for name, (_hint, required) in hints.items() if required and name not in raw]
            if missing:
                raise MessageError(f"{where}: missing field {missing[0]!r}")
            return cls(**{k: self.value(hints[k][0], v, f"{where}.{k}") for k, v in raw.items()})
        if issubclass(cls, tuple) and type(raw) is list:  # a NamedTuple
            return cls(*self._items(list(typing.get_type_hints(cls).values()), raw, where))
        raise MessageError(f"{where}: {_shown(raw)} is not a {_name(cls)}")

    def _items(self, hints: Iterable[Any], raw: list[Any], where: str) -> list[Any]:
        hints = list(hints)
        if len(hints) != len(raw):
            raise MessageError(f"{where}: {len(raw)} items where {len(hints)} go")
        return [self.value(h, v, f"{where}[{i}]") for i, (h, v) in enumerate(zip(hints, raw, strict=True))]


def reply_type(cls: type[Message[Any]]) -> Any:
    """The ``R`` of a ``Message[R]`` subclass."""
    for klass in cls.__mro__:
        for base in klass.__dict__.get("__orig_bases__", ()):
            if typing.get_origin(base) is Message:
                return typing.get_args(base)[0]
    raise TypeError(f"{cls.__name__} does not say what its reply is (derive it from Message[Reply])")


@functools.cache
def _fields(cls: type) -> dict[str, tuple[Any, bool]]:
    """A dataclass's fields: their types, and whether a message must give them."""
    hints = typing.get_type_hints(cls)
    return {f.name: (hints[f.name], f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING)
            for f in dataclasses.fields(cls) if f.init}


def _name(hint: Any) -> str:
    return "null" if hint is type(None) else getattr(hint, "__name__", str(hint))


def _shown(raw: Any) -> str:
    text = repr(raw)
    return text if len(text) <= 40 else text[:37] + "..."
