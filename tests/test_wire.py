"""shared/control/wire.py: every message survives a round trip, and every malformed frame is a WireError."""

import ast
import subprocess
import sys
from pathlib import Path

import msgpack
import pytest

from shared.control import messages as m
from shared.control import wire

LAYOUT = m.KvLayout(num_layers=30, num_pages=1024, page_size=16, num_kv_heads=3, head_dim=64,
                    dtype="bfloat16", shard_stride_bytes=3_145_728)
HANDLES = [m.KvPoolHandle(backend="shm", locator=b"pdserve-kv-prefill-0-5e1f-1234", layout=LAYOUT, first_kv_head=0),
           m.KvPoolHandle(backend="nixl", locator=b"\x95\xc4\x03md!\x00\x01\xa4DRAM\x00", layout=LAYOUT,
                          first_kv_head=3)]
SAMPLING = m.SamplingParams(temperature=0.7, top_p=0.9, top_k=40, seed=(1 << 63) - 1)
STOP = m.StopParams(max_tokens=128, ignore_eos=True)
FINGERPRINT = m.ModelFingerprint("790f0a82", "450cce6e", "c09bf4d0", "bfloat16",
                                 "layers=32 kv_heads=8 head_dim=128 page_size=16")

# One instance per message type; where a type has an optional field, both None and set appear.
SAMPLES = [
    m.Register("prefill-0", m.Role.PREFILL, m.PROTOCOL_VERSION, "a1b2c3", 4242, 1024, 16, 0, 0, HANDLES, FINGERPRINT),
    m.Register("decode-0", m.Role.DECODE, m.PROTOCOL_VERSION, "d4e5f6", 4243, 2048, 16, 64, 4096, [], FINGERPRINT),
    m.Registered(router_epoch="9f8e7d"),
    m.Refused("protocol version 1, but this router speaks 2"),
    m.Heartbeat("decode-0", "9f8e7d", free_pages=2000, running=3, waiting=0, stalled_s=0.25,
                holding=["4bd3a0c1", "77e0"]),
    m.Reregister(),
    m.Deregister("decode-0"),
    m.Drain(),
    m.Draining("decode-0"),
    m.Drained(),
    m.KvCacheEvents("prefill-0", stored=["9a0f", "77c1"], evicted=["0b3e"], cleared=False),
    m.PoolAvailable("prefill-0", HANDLES),
    m.PoolGone("prefill-0"),
    m.PoolUnreachable("prefill-0", "no backend here pulls a 'nixl' pool"),
    m.PrefillTask("req-1", wire.pack_token_ids([1, 2, 3, 49151]), "tenant-a", SAMPLING, STOP, generated=2),
    m.KvReady("req-1", "prefill-0", wire.pack_page_ids([0, 5, 7]), 40, 17, None, compute_s=0.25, cached_tokens=32),
    m.KvReady("req-2", "prefill-0", wire.pack_page_ids([3]), 2, 2, m.FinishReason.STOP, compute_s=0.1,
              cached_tokens=0),
    m.DecodeTask("req-1", "prefill-0", wire.pack_page_ids([0, 5, 7]), 40, 17, SAMPLING, STOP, generated=2),
    m.KvPulled("req-1", "prefill-0", pull_s=0.003),
    m.ReleaseKv("req-1"),
    m.TokenBatch([m.TokenOut("req-1", 18, None), m.TokenOut("req-3", 2, m.FinishReason.LENGTH)], 0.0125,
                 [m.Joined("req-3", 0.0004)]),
    m.TokenBatch([]),
    m.Abort("req-1"),
    m.Failed("req-1", m.ErrorCode.RESOURCE_EXHAUSTED, "no KV room after 30 s"),
]


def test_samples_cover_every_message_type():
    assert {type(s) for s in SAMPLES} == set(m.MESSAGE_TYPES.values())


@pytest.mark.parametrize("message", SAMPLES, ids=lambda s: type(s).__name__)
def test_round_trip(message):
    decoded = wire.decode(wire.encode(message))
    assert type(decoded) is type(message)
    assert decoded == message


def test_round_trip_restores_enum_and_nested_types():
    def sample(kind, where=lambda s: True):
        return next(s for s in SAMPLES if isinstance(s, kind) and where(s))

    register = wire.decode(wire.encode(sample(m.Register, lambda s: s.pool_handles)))
    assert type(register.role) is m.Role
    assert [type(h) for h in register.pool_handles] == [m.KvPoolHandle, m.KvPoolHandle]
    assert all(type(h.layout) is m.KvLayout and type(h.locator) is bytes for h in register.pool_handles)
    assert type(register.fingerprint) is m.ModelFingerprint
    batch = wire.decode(wire.encode(sample(m.TokenBatch, lambda s: len(s.tokens) == 2)))
    assert [type(t) for t in batch.tokens] == [m.TokenOut, m.TokenOut]
    assert type(batch.tokens[1].finish_reason) is m.FinishReason
    failed = wire.decode(wire.encode(sample(m.Failed)))
    assert type(failed.code) is m.ErrorCode


def test_int_on_the_wire_for_a_float_field_becomes_a_float():
    decoded = wire.decode(_frame(HEARTBEAT, "decode-0", "e", 1, 0, 0, 5, []))
    assert decoded == m.Heartbeat("decode-0", "e", 1, 0, 0, 5.0, []) and type(decoded.stalled_s) is float


def _frame(*items) -> bytes:
    return msgpack.packb(list(items), use_bin_type=True)


HEARTBEAT = int(m.MsgKind.HEARTBEAT)
PREFILL_TASK = int(m.MsgKind.PREFILL_TASK)
ONE_TOKEN = wire.pack_token_ids([1])
SAMPLING_RAW = [0.7, 0.9, 40, 1]
STOP_RAW = [16, False]

BAD_FRAMES = {
    "garbage bytes": b"\xc1\xc1\xc1 not msgpack",
    "truncated array": b"\x93\x03",
    "trailing bytes": _frame(HEARTBEAT, "decode-0", "e", 1, 0, 0, 0.0, []) + b"\x00",
    "empty frame": b"",
    "not a list": msgpack.packb({"kind": HEARTBEAT}),
    "a bare int": msgpack.packb(HEARTBEAT),
    "empty list": _frame(),
    "kind is a string": _frame("HEARTBEAT", "decode-0", "e", 1, 0, 0, 0.0, []),
    "kind is a bool": _frame(True),
    "unknown kind": _frame(99, "decode-0", "e", 1, 0, 0, 0.0, []),
    "too few fields": _frame(HEARTBEAT, "decode-0", "e", 1, 0, 0, 0.0),
    "too many fields": _frame(HEARTBEAT, "decode-0", "e", 1, 0, 0, 0.0, [], 0),
    "bool for int": _frame(HEARTBEAT, "decode-0", "e", True, 0, 0, 0.0, []),
    "float for int": _frame(HEARTBEAT, "decode-0", "e", 1.0, 0, 0, 0.0, []),
    "int for str": _frame(HEARTBEAT, 7, "e", 1, 0, 0, 0.0, []),
    "str for float": _frame(HEARTBEAT, "decode-0", "e", 1, 0, 0, "now", []),
    "bool for float": _frame(HEARTBEAT, "decode-0", "e", 1, 0, 0, True, []),
    "str for packed token ids": _frame(PREFILL_TASK, "r", "1 2 3", "", SAMPLING_RAW, STOP_RAW, 0),
    "int list for packed token ids": _frame(PREFILL_TASK, "r", [1, 2], "", SAMPLING_RAW, STOP_RAW, 0),
    "nested struct wrong count": _frame(PREFILL_TASK, "r", ONE_TOKEN, "", [0.7, 0.9, 40], STOP_RAW, 0),
    "nested struct as map": _frame(PREFILL_TASK, "r", ONE_TOKEN, "", {"temperature": 0.7}, STOP_RAW, 0),
    "bool field given int": _frame(PREFILL_TASK, "r", ONE_TOKEN, "", SAMPLING_RAW, [16, 0], 0),
    "invalid role": _frame(int(m.MsgKind.REGISTER), "w", "router", 2, "i", 1, 1, 16, 0, None,
                           ["c", "w", "t", "float32", "layers=1"]),
    "invalid finish reason": _frame(int(m.MsgKind.KV_READY), "r", "p", b"\0\0\0\0", 1, 2, "eos", 0.0, 0),
    "invalid error code": _frame(int(m.MsgKind.FAILED), "r", "NOT_FOUND", "x"),
    "None for required field": _frame(HEARTBEAT, None, "e", 1, 0, 0, 0.0, []),
    "int inside str list": _frame(HEARTBEAT, "decode-0", "e", 1, 0, 0, 0.0, ["r", 7]),
    "list entry not a struct": _frame(int(m.MsgKind.TOKEN_BATCH), [["r", 1, None], 5], 2.5, []),
    "list entry wrong count": _frame(int(m.MsgKind.TOKEN_BATCH), [["r", 1]], 2.5, []),
    "str for bytes": _frame(int(m.MsgKind.POOL_AVAILABLE), "p",
                            ["shm", "name", [1, 1, 1, 1, 1, "float32", 256]]),
    "frame too large": b"\x00" * (wire.MAX_FRAME_BYTES + 1),
    # An array header that claims more elements than allowed, with no elements after it: the
    # unpacker must refuse on the header instead of trying to allocate or read them.
    "array header over MAX_ARRAY_LEN": b"\xdd" + (wire.MAX_ARRAY_LEN + 1).to_bytes(4, "big"),
    "array header of 2**32-1": b"\xdd\xff\xff\xff\xff",
    "nested array header over MAX_ARRAY_LEN":
        b"\x97" + msgpack.packb(PREFILL_TASK) + msgpack.packb("r") + b"\xdd"
        + (wire.MAX_ARRAY_LEN + 1).to_bytes(4, "big"),
}


def _oversized_but_well_formed() -> dict[str, bytes]:
    """Frames valid in every way but one limit, so only that limit can refuse them (msgpack's
    own defaults, derived from the buffer size, would let each of them through)."""
    locator = b"x" * (wire.MAX_FRAME_BYTES - 100)  # under max_bin_len; the frame is over the limit
    layout = [1, 1, 1, 1, 1, "float32", 256]
    too_many_keys = ["k"] * (wire.MAX_ARRAY_LEN + 1)
    return {
        "valid message over MAX_FRAME_BYTES":
            _frame(int(m.MsgKind.POOL_AVAILABLE), "p" * 200, ["shm", locator, layout]),
        "page keys over MAX_ARRAY_LEN": _frame(int(m.MsgKind.KV_CACHE_EVENTS), "p", too_many_keys, [], False),
        "worker id over MAX_STR_BYTES": _frame(HEARTBEAT, "w" * (wire.MAX_STR_BYTES + 1), 1, 0, 0),
    }


OVERSIZED = _oversized_but_well_formed()


@pytest.mark.parametrize("frame", OVERSIZED.values(), ids=OVERSIZED.keys())
def test_oversized_frame_is_refused_by_its_limit(frame):
    unlimited = msgpack.unpackb(frame, max_bin_len=len(frame), max_str_len=len(frame), max_array_len=len(frame))
    assert isinstance(unlimited, list) and unlimited[0] in iter(m.MsgKind)  # well formed apart from its size
    with pytest.raises(wire.WireError):
        wire.decode(frame)


def test_frame_size_is_checked_before_unpacking():
    frame = OVERSIZED["valid message over MAX_FRAME_BYTES"]
    assert len(frame) > wire.MAX_FRAME_BYTES
    with pytest.raises(wire.WireError, match="exceeds"):
        wire.decode(frame)


@pytest.mark.parametrize("frame", BAD_FRAMES.values(), ids=BAD_FRAMES.keys())
def test_bad_frame_is_a_wire_error(frame):
    with pytest.raises(wire.WireError):
        wire.decode(frame)


def test_sample_frames_for_bad_cases_are_otherwise_well_formed():
    """The bad frames above differ from valid ones only in the flaw they name."""
    assert wire.decode(_frame(HEARTBEAT, "decode-0", "e", 1, 0, 0, 0.0, [])) == m.Heartbeat(
        "decode-0", "e", 1, 0, 0, 0.0, [])
    assert wire.decode(_frame(PREFILL_TASK, "r", ONE_TOKEN, "", SAMPLING_RAW, STOP_RAW, 0)) == m.PrefillTask(
        "r", ONE_TOKEN, "", m.SamplingParams(0.7, 0.9, 40, 1), m.StopParams(16, False))
    assert wire.decode(_frame(int(m.MsgKind.KV_CACHE_EVENTS), "p", ["k"] * wire.MAX_ARRAY_LEN, [], False)) \
        == m.KvCacheEvents("p", ["k"] * wire.MAX_ARRAY_LEN, [], False)
    assert wire.decode(_frame(int(m.MsgKind.TOKEN_BATCH), [["r", 1, None]], 2.5, [["r", 0.5]])) == m.TokenBatch(
        [m.TokenOut("r", 1, None)], 2.5, [m.Joined("r", 0.5)])


def test_a_prompt_of_the_longest_context_travels_packed_and_comes_back_whole():
    """A million ids (twice the 512K context): 8 MB, within a frame; the ids come back as they went."""
    token_ids = list(range(wire.MAX_ARRAY_LEN - 3)) + [2 ** 31 - 1, 0, 128_255]
    task = m.PrefillTask("long", wire.pack_token_ids(token_ids), "", SAMPLING, STOP)
    assert wire.unpack_token_ids(wire.decode(wire.encode(task)).prompt_token_ids).tolist() == token_ids
    with pytest.raises(wire.WireError, match="not whole"):
        wire.unpack_token_ids(task.prompt_token_ids[:-1])


@pytest.mark.e2e
def test_wire_does_not_import_pickle():
    source = Path(wire.__file__).read_text()
    imported = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            imported |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            imported.add(node.module.split(".")[0])
    assert not imported & {"pickle", "cPickle", "cloudpickle", "dill", "_pickle"}
    # Nor anything it imports, transitively: checked in a fresh interpreter.
    code = ("import sys, shared.control.wire; "
            "bad = sorted(n for n in sys.modules if 'pickle' in n or n == 'dill'); "
            "assert not bad, bad")
    repo = Path(wire.__file__).resolve().parents[2]
    done = subprocess.run([sys.executable, "-c", code], cwd=repo, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr


def test_page_ids_travel_packed_and_come_back_whole():
    packed = wire.pack_page_ids([0, 5, 2 ** 31 - 1])
    assert len(packed) == 3 * wire.PAGE_ID_BYTES
    assert list(wire.unpack_page_ids(packed)) == [0, 5, 2 ** 31 - 1]
    with pytest.raises(wire.WireError, match="not whole"):
        wire.unpack_page_ids(packed[:-1])
