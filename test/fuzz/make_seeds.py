#!/usr/bin/env python3
"""Writes the fuzz target's seed inputs (test/fuzz/seeds/): well-formed
frames of every type, aimed at the fixed registered region (0x500000000000,
rkey 257), so that libFuzzer starts from inputs that reach deep states."""
import os
import struct

BASE, RKEY = 0x500000000000, (1 << 18) | 1  # frame_fuzz.cpp: the first key of a deterministic domain
WIRE_VERSION = 2  # transport/tcp/wire.hpp kWireVersion
LAST = 2          # kFlagLast: the last frame of a read response
here = os.path.join(os.path.dirname(os.path.abspath(__file__)), "seeds")


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
}
os.makedirs(here, exist_ok=True)
for name, data in seeds.items():
    with open(os.path.join(here, name), "wb") as f:
        f.write(data)
