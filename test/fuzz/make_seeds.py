#!/usr/bin/env python3
"""Writes the fuzz targets' seed inputs (test/fuzz/seeds/<target>/): for the
tcp provider's frames, well-formed frames of every type aimed at the fixed
registered region (0x500000000000, rkey 262145); for each other decoder,
well-formed inputs of every kind it knows, so that libFuzzer starts from
inputs that reach deep states.
  make_seeds.py [DIR]   (default: test/fuzz/seeds next to this script; the
                         fuzz-seeds-current test writes elsewhere and compares)"""
import os
import re
import struct
import sys

BASE, RKEY = 0x500000000000, (1 << 18) | 1  # frame_fuzz.cpp: the first key of a deterministic domain
SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")


def constant(header, name):
    """The value of `inline constexpr ... name = N;` in a header of the tree."""
    with open(os.path.join(SOURCE, header)) as f:
        m = re.search(r"\b" + name + r"\s*=\s*(\d+)\s*;", f.read())
    if m is None:
        sys.exit(f"make_seeds.py: no {name} in {header}")
    return int(m.group(1))


WIRE_VERSION = constant("transport/tcp/wire.hpp", "kWireVersion")  # the tcp provider's frames
RUNTIME_VERSION = constant("runtime/protocol.hpp", "kVersion")      # the runtime's hello
LAST = 2          # kFlagLast: the last frame of a read response
ACKED = 4         # kFlagAck: a request that carries an ACK (offset 28, rlen here)
root = sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(os.path.abspath(__file__)), "seeds")


def frame(t, psn, length=0, imm=0, addr=0, rkey=0, rlen=0, ca=0, swap=0, flags=0, payload=b""):
    return struct.pack("<BBHIIIQIIQQ", WIRE_VERSION, t, flags, psn, length, imm, addr, rkey, rlen, ca, swap) + payload


SEND, WRITE, READ, FADD, CAS, ACK, NAK, RRESP, ARESP = 1, 2, 3, 4, 5, 16, 17, 18, 19
seeds = {
    "write": frame(WRITE, 1, 16, addr=BASE + 8, rkey=RKEY, payload=b"A" * 16),
    "write_imm": frame(WRITE, 1, 8, imm=7, addr=BASE, rkey=RKEY, flags=1, payload=b"B" * 8),
    "send": frame(SEND, 1, 32, payload=b"C" * 32) + frame(SEND, 2, 4, imm=9, flags=1, payload=b"DDDD"),
    "read": frame(READ, 1, addr=BASE, rkey=RKEY, rlen=128),
    "atomics": frame(FADD, 1, addr=BASE, rkey=RKEY, ca=5) + frame(CAS, 2, addr=BASE, rkey=RKEY, ca=5, swap=1),
    # second half: responses to the target's own read, send and fetch_add
    "responses": frame(WRITE, 1, 0, addr=BASE, rkey=RKEY)
    + frame(RRESP, 1, 64, payload=b"E" * 64) + frame(RRESP, 1, addr=64, flags=LAST) + frame(ACK, 2)
    + frame(ARESP, 3, ca=42),
    "nak": b"\0" * 48 + frame(NAK, 1, imm=1),  # an RNR NAK (nak_code::rnr)
    # the target's send acknowledged in the header of a request, not a frame of its own
    "piggyback": frame(WRITE, 1, 0, addr=BASE, rkey=RKEY)
    + frame(RRESP, 1, 64, payload=b"F" * 64) + frame(RRESP, 1, addr=64, flags=LAST)
    + frame(SEND, 1, 8, rlen=2, flags=ACKED, payload=b"G" * 8) + frame(ARESP, 3, ca=42),
    # an RNR NAK for the target's read, then the read's data (refused)
    "rnr_read": frame(WRITE, 1, 0, addr=BASE, rkey=RKEY) + frame(NAK, 1, imm=1)
    + frame(RRESP, 1, 64, payload=b"H" * 64) + frame(RRESP, 1, addr=64, flags=LAST),
    "piggyback_atomic": frame(FADD, 1, addr=BASE, rkey=RKEY, ca=1, rlen=0xffffffff, flags=ACKED),
}


def write(target, named):
    d = os.path.join(root, target)
    os.makedirs(d, exist_ok=True)
    for name, data in named.items():
        with open(os.path.join(d, name), "wb") as f:
            f.write(data)


write("frames", seeds)

# --- handshake: the tcp provider's 24-byte frame, then the runtime's hello
# (runtime/protocol.hpp, version 8) in its private data.
def tcp_handshake(kind, pdata):
    return b"ADTP" + struct.pack("<BBHIII4x", WIRE_VERSION, kind, len(pdata), 7, 128, 64) + pdata


def hello(kind, flags=0, credits=64, nonce=b"\0" * 16, version=RUNTIME_VERSION, reason=0, keepalive=10000, max_credits=None):
    return (struct.pack("<IHBBHHIIQ", 0x31524441, version, kind, reason, credits, flags, 8256, 8192, 1 << 30) + nonce
            + struct.pack("<IH", keepalive, credits if max_credits is None else max_credits))


write("handshake", {
    "hello": tcp_handshake(1, hello(1)),
    "hello_auth": tcp_handshake(1, hello(1, 1, nonce=bytes(range(16)))),
    "welcome_auth": tcp_handshake(2, hello(2, 1, nonce=bytes(range(16, 32)))),
    "refuse": tcp_handshake(3, struct.pack("<IHBB", 0x31524441, RUNTIME_VERSION, 3, 2)),
    "old_version": tcp_handshake(1, hello(1, version=2)),
})

# --- region: remote_region's wire forms, versions 1 and 2 (include/anydoor/memory.hpp).
def fnv1a32(b):
    h = 2166136261
    for c in b:
        h = ((h ^ c) * 16777619) & 0xffffffff
    return h


def region(addr, length, rkey):
    body = b"ADRR" + bytes([1, 0, 0, 0]) + struct.pack("<QQI", addr, length, rkey)
    return body + struct.pack("<I", fnv1a32(body))


def region_pieces(addr, length, shift, keys):
    body = (b"ADRR" + bytes([2, shift, 0, 0]) + struct.pack("<QQI", addr, length, len(keys))
            + b"".join(struct.pack("<I", k) for k in keys))
    return body + struct.pack("<I", fnv1a32(body))


write("region", {
    "small": region(0x7f0000001000, 4096, 0x40001),
    "pieces": region_pieces(0x7f0000001100, 3 * 4096, 12, [11, 12, 13, 14]),
    "pieces_big": region_pieces(0x7f0000000000, 1 << 31, 30, [21, 22]),
    "top": region(0xffffffffffff0000, 0x10000, 1),
    "one": region(1, 1, 0),
})

# --- kv-log: the kv store's log (apps/kv/log.cpp): header, then records
# u32 crc32c | u8 type | u24 check | u32 key length | u32 value length | key | value.
# Version 1: salt 0, check 0; version 2: both CRCs seeded with the header's salt.
def crc32c(data, crc=0):
    crc ^= 0xffffffff
    for c in data:
        crc ^= c
        for _ in range(8):
            crc = (crc >> 1) ^ (0x82f63b78 if crc & 1 else 0)
    return crc ^ 0xffffffff


def record(t, key, value=b"", salt=0):
    lengths = struct.pack("<II", len(key), len(value))
    check = 0 if salt == 0 else crc32c(bytes([t]) + lengths, salt ^ 0x9e3779b9) & 0xffffff
    body = bytes([t]) + check.to_bytes(3, "little") + lengths + key + value
    return struct.pack("<I", crc32c(body, salt)) + body


LOG = b"ADKVLOG1" + struct.pack("<II", 1, 0)
SALT = 0x5eed1234
LOG2 = b"ADKVLOG1" + struct.pack("<II", 2, SALT)
write("kv-log", {
    "puts": LOG + record(1, b"k1", b"v1") + record(1, b"key-2", b"x" * 200) + record(2, b"k1"),
    "torn": LOG + record(1, b"a", b"b") + record(1, b"c", b"d" * 40)[:30],
    "corrupt": LOG + record(1, b"a", b"b")[:-1] + b"X" + record(1, b"c", b"d"),
    "empty": LOG,
    "salted": LOG2 + record(1, b"k1", b"v1", SALT) + record(1, b"key-2", b"x" * 200, SALT) + record(2, b"k1", salt=SALT),
    # A value holding records of other salts, cut short after them: torn.
    "salted_torn": LOG2 + record(1, b"a", b"b", SALT)
    + record(1, b"c", b"d" * 40 + record(1, b"f", b"g", SALT ^ 1) + record(1, b"h", b"i") + b"e" * 20, SALT)[:-10],
})

# --- resp: Redis protocol requests (the first byte picks the fuzzer's piece size).
write("resp", {
    "pipeline": b"\x03*3\r\n$3\r\nSET\r\n$1\r\nk\r\n$5\r\nhello\r\n*2\r\n$3\r\nGET\r\n$1\r\nk\r\n",
    "inline": b"\x01PING\r\nSET a \"quoted \\x41 value\" \r\nECHO 'single'\n\r\n",
    "empty_array": b"\x07*0\r\n*-1\r\n*1\r\n$0\r\n\r\n",
    "bad_length": b"\x02*1\r\n$-5\r\n",
})

# --- messages: a live runtime's peer (engine_fuzz.cpp): [u8 length][message]
# with runtime headers u8 type | u8 status | u16 credits | u32 aux (+ body).
PEER, PEER_RKEY = 0x510000000000, (1 << 18) | 1


def msg(t, status=0, credits=0, aux=0, body=b""):
    m = struct.pack("<BBHI", t, status, credits, aux) + body
    return bytes([len(m)]) + m


def rts_body(length, addr, rkey, cookie):
    return struct.pack("<QQII", length, addr, rkey, cookie)


EAGER, RTS, FIN, CREDIT, CLOSE, NOTIFY, AUTH, SPLIT, WITHDRAW = 1, 2, 3, 4, 5, 6, 7, 8, 9
write("messages", {
    "eager": msg(EAGER, body=b"abcd") + msg(EAGER, body=b"x" * 200),
    "rendezvous": msg(RTS, body=rts_body(512, PEER, PEER_RKEY, 7)) + msg(EAGER, body=b"after"),
    "fin": msg(FIN, aux=1) + msg(FIN, status=1, aux=1),
    "credit_close": msg(CREDIT) + msg(CLOSE),
    "notify": msg(NOTIFY, aux=5, body=rts_body(64, PEER + 128, PEER_RKEY, 0)),
    "auth": msg(AUTH, body=b"\0" * 32),
    "split": msg(SPLIT, aux=300, body=b"a" * 200) + msg(CREDIT) + msg(SPLIT, aux=300, body=b"b" * 100)
    + msg(EAGER, body=b"after"),
    "split_broken": msg(SPLIT, aux=100, body=b"a" * 50) + msg(EAGER, body=b"x"),
    "auth_confirmed": msg(AUTH, status=2) + msg(AUTH, status=1),
    "withdraw": msg(RTS, body=rts_body(512, PEER, PEER_RKEY, 7)) + msg(RTS, body=rts_body(256, PEER, PEER_RKEY, 8))
    + msg(WITHDRAW, aux=7) + msg(WITHDRAW, aux=99) + msg(WITHDRAW, status=1, aux=8) + msg(EAGER, body=b"after"),
    "mixed": msg(EAGER, body=b"1") + msg(RTS, body=rts_body(300, PEER + 4096, PEER_RKEY, 9)) + msg(FIN, aux=1)
    + msg(NOTIFY, aux=1, body=rts_body(8, PEER, PEER_RKEY, 0)) + msg(CREDIT) + msg(CLOSE),
})


# --- rpc: the RPC server's request frames (runtime/rpc/wire.hpp), each
# [u8 length][frame]: u8 version 1 | u8 kind | u8 flags | u8 0 | u32 aux |
# u64 call id | u64 method, then [bulk region] [payload].
def frame(kind, call, method=0, flags=0, aux=0, rest=b""):
    f = struct.pack("<BBBBIQQ", 1, kind, flags, 0, aux, call, method) + rest
    return bytes([len(f)]) + f


def chunk(b):
    return bytes([len(b)]) + b


write("rpc", {
    "echo": frame(1, 1, 1, rest=b"hello") + frame(1, 2, 1, aux=1000, rest=b"x" * 100),
    "bulk": frame(1, 3, 2, flags=1, rest=region(PEER, 1024, PEER_RKEY)),
    "big_reply": frame(1, 4, 3),
    "payload_follows": frame(1, 5, 1, flags=2) + chunk(b"the payload, its own message"),
    "cancel": frame(1, 6, 2, flags=1, rest=region(PEER, 4096, PEER_RKEY)) + frame(3, 6),
    "unknown": frame(1, 7, 99) + frame(2, 7) + frame(1, 8, 1, flags=4),
})
