"""msgpack encoding of shared/control/messages.py, with typed, size-limited decoding.

A frame is `[kind, field0, field1, ...]` with fields in declaration order and nested dataclasses
as arrays. Decoding checks every field against its annotation, so a peer's bug or a hostile
frame becomes a WireError instead of a wrong-typed value deep inside a service. msgpack is
unpacked with hard limits; pickle is never used.
"""

from __future__ import annotations

import array
import dataclasses
import enum
import functools
import types
import typing
from collections.abc import Sequence

import msgpack

from shared.control.messages import MESSAGE_TYPES, MsgKind

MAX_FRAME_BYTES = 16 * 1024 * 1024
# The page keys of a prompt of the longest context we serve (32K for 512K tokens), with room to spare;
# bounds what one array may claim.
MAX_ARRAY_LEN = 1 << 20
MAX_STR_BYTES = 1 << 20

KIND_OF: dict[type, MsgKind] = {cls: kind for kind, cls in MESSAGE_TYPES.items()}
# Page ids travel packed, not as a msgpack list: a list costs a Python step per id at each end
# it crosses (the prefill, the router in and out, the decode), 512 ids for an 8K-token prompt.
PAGE_ID_TYPECODE = "i"  # C int in the host's byte order: every host pdserve runs on is little-endian
PAGE_ID_BYTES = array.array(PAGE_ID_TYPECODE).itemsize
# A prompt's token ids likewise, 8 bytes each: the embedding's index type, and the width the page keys
# hash (shared/kv/page_keys.py). As a list, 128K ids took 15 ms to decode and check on a CPU machine,
# and torch.tensor of that list 42 ms more.
TOKEN_ID_TYPECODE = "q"
TOKEN_ID_BYTES = array.array(TOKEN_ID_TYPECODE).itemsize


class WireError(ValueError):
    """A frame that is not a valid message; the receiver logs and drops it."""


class EncodeError(ValueError):
    """A message that msgpack cannot pack (an integer beyond 64 bits, a type it does not know): a
    value that no check stopped. Raised to the sender, whose message it concerns; nothing was sent."""


def encode(message: object) -> bytes:
    try:
        return msgpack.packb([int(KIND_OF[type(message)]), *_to_plain(message)], use_bin_type=True)
    except (OverflowError, TypeError, ValueError) as exc:
        raise EncodeError(f"{type(message).__name__} cannot be encoded: {exc}") from exc


def pack_page_ids(pages: list[int]) -> bytes:
    return array.array(PAGE_ID_TYPECODE, pages).tobytes()


def unpack_page_ids(packed: bytes) -> memoryview:
    """A read-only view of the packed ids as ints."""
    if len(packed) % PAGE_ID_BYTES:
        raise WireError(f"{len(packed)} bytes are not whole {PAGE_ID_BYTES}-byte page ids")
    return memoryview(packed).cast(PAGE_ID_TYPECODE)


def pack_token_ids(token_ids: Sequence[int]) -> bytes:
    return array.array(TOKEN_ID_TYPECODE, token_ids).tobytes()


def unpack_token_ids(packed: bytes) -> array.array:
    """The ids as an int64 array."""
    if len(packed) % TOKEN_ID_BYTES:
        raise WireError(f"{len(packed)} bytes are not whole {TOKEN_ID_BYTES}-byte token ids")
    token_ids = array.array(TOKEN_ID_TYPECODE)
    token_ids.frombytes(packed)
    return token_ids


def decode(frame: bytes) -> object:
    raw = _unpack(frame)
    if not isinstance(raw, list) or not raw or type(raw[0]) is not int:
        raise WireError("frame is not [kind, ...]")
    try:
        cls = MESSAGE_TYPES[MsgKind(raw[0])]
    except ValueError:
        raise WireError(f"unknown message kind {raw[0]}") from None
    return _build(cls, raw[1:], cls.__name__)


def claimed_protocol_version(frame: bytes) -> int | None:
    """The version a Register that does not decode claims (its third field in every version), so
    that the router can refuse a worker of another version with the reason instead of ignoring it."""
    try:
        raw = _unpack(frame)
    except WireError:
        return None
    if isinstance(raw, list) and len(raw) > 3 and raw[0] == MsgKind.REGISTER and type(raw[3]) is int:
        return raw[3]
    return None


def _unpack(frame: bytes) -> object:
    if len(frame) > MAX_FRAME_BYTES:
        raise WireError(f"frame of {len(frame)} bytes exceeds {MAX_FRAME_BYTES}")
    try:
        return msgpack.unpackb(
            frame, raw=False, strict_map_key=True, use_list=True,
            max_bin_len=MAX_FRAME_BYTES, max_str_len=MAX_STR_BYTES,
            max_array_len=MAX_ARRAY_LEN, max_map_len=1024, max_ext_len=0,
        )
    except Exception as exc:  # msgpack raises several unrelated types for bad input
        raise WireError(f"not msgpack: {exc}") from None


def _to_plain(obj: object) -> list:
    out = []
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            value = _to_plain(value)
        elif isinstance(value, list) and value and dataclasses.is_dataclass(value[0]):
            value = [_to_plain(v) for v in value]
        out.append(value)
    return out


@functools.cache
def _field_types(cls: type) -> list[tuple[str, object]]:
    hints = typing.get_type_hints(cls)
    return [(f.name, hints[f.name]) for f in dataclasses.fields(cls)]


def _build(cls: type, values: object, where: str) -> object:
    fields = _field_types(cls)
    if not isinstance(values, list) or len(values) != len(fields):
        raise WireError(f"{where}: expected {len(fields)} fields")
    return cls(**{name: _check(value, kind, f"{where}.{name}") for (name, kind), value in zip(fields, values)})


def _check(value: object, kind: object, where: str) -> object:
    origin = typing.get_origin(kind)
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(kind)
        if value is None and type(None) in options:
            return None
        (inner,) = [t for t in options if t is not type(None)]
        return _check(value, inner, where)
    if origin is list:
        (item,) = typing.get_args(kind)
        if not isinstance(value, list):
            raise WireError(f"{where}: expected a list")
        if item in (int, str) and all(type(v) is item for v in value):
            return value  # fast path: page key lists (KvCacheEvents) are the longest that travel
        return [_check(v, item, where) for v in value]
    if dataclasses.is_dataclass(kind):
        return _build(kind, value, where)
    if isinstance(kind, type) and issubclass(kind, enum.Enum):
        try:
            return kind(value)
        except ValueError:
            raise WireError(f"{where}: {value!r} is not a {kind.__name__}") from None
    if kind is float and type(value) is int:
        return float(value)
    if type(value) is not kind:  # exact: bool must not pass for int
        raise WireError(f"{where}: expected {getattr(kind, '__name__', kind)}, got {type(value).__name__}")
    return value
