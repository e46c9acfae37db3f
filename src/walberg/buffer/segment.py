"""The byte format of a segment file: framing only, no file I/O.

A segment file is ``MAGIC`` followed by frames. A frame is a 17-byte header, struct
``<IIQB`` = (payload length, CRC32, lsn, kind), then the payload. The CRC covers the 9
bytes lsn+kind followed by the payload, so a flipped bit in any field except the length
is caught by the checksum, and a damaged length is caught either by the absurd-length
limit or by the CRC of the bytes it then points at.

This module owns encoding (``encode_frame``, ``append_frame``) and decoding (``Scanner``,
``scan``), including the decision between "the data ends in a torn frame" (a crash while
writing; the caller truncates) and "the data is corrupt" (``SegmentCorrupt``). It does
not interpret payloads; ``kind`` is the caller's to use, except that ``KIND_PREAMBLE_END``
is reserved for the segment store (see ``walberg.buffer.store``).
"""

from __future__ import annotations

import mmap
import struct
import zlib
from collections.abc import Iterator
from typing import NamedTuple, Union

from walberg.errors import SegmentCorrupt

MAGIC = b"WBSEG01\n"

HEADER = struct.Struct("<IIQB")
HEADER_SIZE = HEADER.size  # 17
# Offset of lsn+kind inside the header: the CRC starts there.
_CRC_FROM = 8

# Anything longer is damage, not data: no single replication message is that big, and
# refusing it keeps a flipped high bit in a length from being read as "wait for 3 GiB".
MAX_PAYLOAD = 1 << 30

MAX_LSN = (1 << 64) - 1

# The segment store writes one frame of this kind (lsn 0, empty payload) after the
# preamble frames, so that after a restart it still knows where the preamble ends.
KIND_PREAMBLE_END = 255

# A decoded frame: (lsn, kind, payload). A plain tuple because decoding builds one per
# change and a NamedTuple's constructor costs several times more.
Frame = tuple[int, int, bytes]

BytesLike = Union[bytes, bytearray, memoryview]
# What the decoder reads from: anything sliceable that supports the buffer protocol.
Readable = Union[bytes, bytearray, memoryview, mmap.mmap]

_pack_header = HEADER.pack
_pack_lsn_kind = struct.Struct("<QB").pack
_crc32 = zlib.crc32


class FrameCorrupt(SegmentCorrupt):
    """A frame failed its check. ``offset`` is where the frame starts in the data."""

    def __init__(self, offset: int, reason: str) -> None:
        super().__init__(f"{reason} at byte offset {offset}")
        self.offset = offset
        self.reason = reason


def append_frame(buf: bytearray, lsn: int, kind: int, payload: BytesLike) -> None:
    """Append one encoded frame to ``buf``. On error ``buf`` is left unchanged.

    This is the hot path (once per replicated change), hence the bound struct methods and
    the two in-place extends: no intermediate copy of the payload is made.
    """
    n = len(payload)
    if n > MAX_PAYLOAD:
        raise ValueError(f"frame payload of {n} bytes exceeds the limit of {MAX_PAYLOAD}")
    try:
        buf += _pack_header(n, _crc32(payload, _crc32(_pack_lsn_kind(lsn, kind))), lsn, kind)
    except struct.error:
        raise ValueError(
            f"frame lsn must be 0..2**64-1 and kind 0..255, got lsn={lsn!r} kind={kind!r}"
        ) from None
    buf += payload


def encode_frame(lsn: int, kind: int, payload: BytesLike) -> bytes:
    """One frame as bytes."""
    buf = bytearray()
    append_frame(buf, lsn, kind, payload)
    return bytes(buf)


def check_magic(data: Readable) -> None:
    """Raise ``FrameCorrupt`` unless ``data`` starts with ``MAGIC``."""
    if bytes(data[: len(MAGIC)]) != MAGIC:
        raise FrameCorrupt(0, f"not a walberg segment (expected the magic {MAGIC!r})")


class Scanner:
    """Iterates over the frames of ``data`` from ``start`` and then says how the data ended.

    After iteration finishes, ``valid_end`` is the offset just past the last good frame and
    ``torn`` tells whether bytes after it were dropped as a torn tail. Iteration raises
    ``FrameCorrupt`` (a ``SegmentCorrupt``) when the data is damaged rather than torn.

    ``sealed`` selects how the end is judged. A sealed segment was fsynced before it got
    its name, so any damage, including a short last frame, is corruption. An active
    segment may end in whatever a crash mid-write left behind: a header or payload cut
    short, or a last frame whose CRC does not match. Trailing zero bytes are ignored when
    deciding which frame is the last, because a filesystem can extend a file with
    zero-filled blocks whose data never reached the disk.

    An absurd length (> ``MAX_PAYLOAD``) is corruption in either mode: a crash does not
    write one, and treating it as torn would drop every frame after it.
    """

    def __init__(self, data: Readable, start: int = len(MAGIC), *, sealed: bool = False) -> None:
        if not 0 <= start <= len(data):
            raise ValueError(f"start offset {start} is outside the data (0..{len(data)})")
        self._data = data
        self._start = start
        self._sealed = sealed
        self.valid_end = start
        self.torn = False

    def __iter__(self) -> Iterator[Frame]:
        data = self._data
        end = len(data)
        pos = self._start
        unpack = HEADER.unpack_from
        crc32 = _crc32
        while True:
            if end - pos < HEADER_SIZE:
                if pos != end:
                    self._tail(pos, "the data ends inside a frame header")
                return
            length, crc, lsn, kind = unpack(data, pos)
            if length > MAX_PAYLOAD:
                raise FrameCorrupt(pos, f"frame length {length} is absurd (limit {MAX_PAYLOAD})")
            body = pos + HEADER_SIZE
            stop = body + length
            if stop > end:
                self._tail(pos, f"the data ends inside a frame payload ({length} bytes)")
                return
            payload = data[body:stop]
            if crc32(payload, crc32(data[pos + _CRC_FROM : body])) != crc:
                if not self._sealed and _all_zero(data, stop, end):
                    self._tail(pos, "")
                    return
                raise FrameCorrupt(pos, "frame checksum mismatch")
            yield (lsn, kind, payload if type(payload) is bytes else bytes(payload))
            pos = stop
            self.valid_end = stop

    def _tail(self, pos: int, reason: str) -> None:
        if self._sealed:
            raise FrameCorrupt(pos, f"sealed segment is truncated: {reason}")
        self.valid_end = pos
        self.torn = True


def _all_zero(data: Readable, start: int, end: int) -> bool:
    # Only reached once, at a bad frame, so a copy of the tail is acceptable.
    return not bytes(data[start:end]).strip(b"\0")


class ScanResult(NamedTuple):
    frames: list[Frame]
    valid_end: int  # offset just past the last good frame: truncate here when torn
    torn: bool  # bytes after valid_end were a torn tail (only ever True when not sealed)


def scan(data: Readable, start: int = len(MAGIC), *, sealed: bool = False) -> ScanResult:
    """Decode every frame of ``data`` from ``start`` into a list. See ``Scanner``.

    Does not check ``MAGIC`` (see ``check_magic``). For large data iterate a ``Scanner``
    instead, which does not hold all frames at once.
    """
    scanner = Scanner(data, start, sealed=sealed)
    frames = list(scanner)
    return ScanResult(frames, scanner.valid_end, scanner.torn)
