"""Segment framing (walberg.buffer.segment) and the segment directory (walberg.buffer.store)."""

from __future__ import annotations

import errno
import os
import struct
import subprocess
import sys
import textwrap
import zlib
from collections.abc import Generator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from walberg.buffer import store as store_mod
from walberg.buffer.segment import (
    HEADER_SIZE,
    KIND_PREAMBLE_END,
    MAGIC,
    MAX_PAYLOAD,
    FrameCorrupt,
    Scanner,
    append_frame,
    check_magic,
    encode_frame,
    scan,
)
from walberg.buffer.store import Preamble, SegmentInfo, SegmentStore
from walberg.errors import SegmentCorrupt, Terminal, WalbergError
from walberg.model import Lsn

SRC = Path(__file__).resolve().parents[1] / "src"

Frame = tuple[int, int, bytes]

frames_st = st.lists(
    st.tuples(
        st.integers(0, 2**64 - 1),
        st.integers(0, 255),
        st.binary(max_size=300),
    ),
    max_size=20,
)


def encode_all(frames: list[Frame]) -> tuple[bytes, list[int]]:
    """MAGIC + frames, and the offset where each frame starts."""
    buf = bytearray(MAGIC)
    offsets = []
    for lsn, kind, payload in frames:
        offsets.append(len(buf))
        append_frame(buf, lsn, kind, payload)
    return bytes(buf), offsets


# ---- framing ------------------------------------------------------------------------------


@given(frames_st)
def test_round_trip(frames: list[Frame]) -> None:
    data, _ = encode_all(frames)
    for sealed in (False, True):
        result = scan(data, sealed=sealed)
        assert result.frames == frames
        assert result.valid_end == len(data)
        assert not result.torn
    assert scan(memoryview(data)).frames == frames
    assert scan(bytearray(data)).frames == frames


def test_layout_is_the_documented_one() -> None:
    frame = encode_frame(0x16_B374D848, 7, b"hello")
    length, crc, lsn, kind = struct.unpack_from("<IIQB", frame)
    assert (length, lsn, kind) == (5, 0x16_B374D848, 7)
    assert crc == zlib.crc32(frame[8:17] + b"hello")
    assert frame[17:] == b"hello"
    assert len(frame) == HEADER_SIZE + 5 == 22
    assert MAGIC == b"WBSEG01\n"


def test_append_frame_matches_encode_frame_and_accepts_buffers() -> None:
    buf = bytearray()
    append_frame(buf, 1, 0, memoryview(b"abc"))
    append_frame(buf, 2, 1, bytearray(b""))
    assert bytes(buf) == encode_frame(1, 0, b"abc") + encode_frame(2, 1, b"")


def test_empty_and_large_payloads() -> None:
    big = os.urandom(3 * 1024 * 1024 + 7)
    frames = [(0, 0, b""), (2**64 - 1, 255, big), (5, 1, b"")]
    data, _ = encode_all(frames)
    assert scan(data, sealed=True).frames == frames


@pytest.mark.parametrize(
    ("lsn", "kind"), [(-1, 0), (2**64, 0), (0, -1), (0, 256)]
)
def test_out_of_range_fields_are_refused_and_leave_the_buffer_alone(lsn: int, kind: int) -> None:
    buf = bytearray(b"xyz")
    with pytest.raises(ValueError):
        append_frame(buf, lsn, kind, b"payload")
    assert buf == b"xyz"


def test_oversized_payload_is_refused() -> None:
    class Huge(bytes):
        def __len__(self) -> int:
            return MAX_PAYLOAD + 1

    with pytest.raises(ValueError, match="exceeds"):
        append_frame(bytearray(), 0, 0, Huge(b""))


def test_check_magic() -> None:
    check_magic(MAGIC + b"rest")
    for bad in (b"", MAGIC[:5], b"WBSEG02\n"):
        with pytest.raises(SegmentCorrupt, match="magic"):
            check_magic(bad)


@given(frames_st.filter(bool), st.data())
def test_torn_tail_at_every_cut_of_the_last_frame(frames: list[Frame], data: st.DataObject) -> None:
    encoded, offsets = encode_all(frames)
    last = offsets[-1]
    for cut in range(last + 1, len(encoded)):
        result = scan(encoded[:cut])
        assert result.frames == frames[:-1]
        assert result.valid_end == last
        assert result.torn
        with pytest.raises(FrameCorrupt, match="truncated") as info:
            scan(encoded[:cut], sealed=True)
        assert info.value.offset == last


def test_crc_mismatch_in_last_frame_is_torn_only_when_active() -> None:
    frames = [(1, 0, b"first"), (2, 0, b"second"), (3, 0, b"third")]
    data, offsets = encode_all(frames)
    damaged = bytearray(data)
    damaged[-1] ^= 0x01
    result = scan(bytes(damaged))
    assert result.frames == frames[:2]
    assert (result.valid_end, result.torn) == (offsets[2], True)
    with pytest.raises(FrameCorrupt, match="checksum") as info:
        scan(bytes(damaged), sealed=True)
    assert info.value.offset == offsets[2]


def test_zero_filled_tail_is_torn_when_active() -> None:
    frames = [(1, 0, b"first"), (2, 0, b"second")]
    data, offsets = encode_all(frames)
    # A crash can leave the file extended with zero blocks, past and inside the last frame.
    for tail in (data + bytes(100), data[: offsets[1] + 3] + bytes(50)):
        result = scan(tail)
        assert result.torn
        assert result.valid_end in (len(data), offsets[1])
        assert result.frames == frames[: 2 if result.valid_end == len(data) else 1]
        with pytest.raises(FrameCorrupt):
            scan(tail, sealed=True)


@pytest.mark.parametrize("sealed", [False, True])
def test_bit_flip_in_a_middle_frame_is_corruption(sealed: bool) -> None:
    frames = [(10, 0, b"a" * 40), (11, 0, b"b" * 40), (12, 1, b"c" * 40)]
    data, offsets = encode_all(frames)
    middle = offsets[1]
    # Every byte except the length: those are all under the CRC.
    for pos in range(middle + 4, offsets[2]):
        damaged = bytearray(data)
        damaged[pos] ^= 0x10
        with pytest.raises(FrameCorrupt, match="checksum") as info:
            scan(bytes(damaged), sealed=sealed)
        assert info.value.offset == middle
        assert f"offset {middle}" in str(info.value)


@pytest.mark.parametrize("sealed", [False, True])
def test_absurd_length_is_corruption(sealed: bool) -> None:
    data, offsets = encode_all([(1, 0, b"x"), (2, 0, b"y")])
    damaged = bytearray(data)
    struct.pack_into("<I", damaged, offsets[0], MAX_PAYLOAD + 1)
    with pytest.raises(FrameCorrupt, match="absurd") as info:
        scan(bytes(damaged), sealed=sealed)
    assert info.value.offset == offsets[0]


@settings(suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=400), st.booleans())
def test_random_bytes_never_crash(garbage: bytes, sealed: bool) -> None:
    data = MAGIC + garbage
    try:
        result = scan(data, sealed=sealed)
    except SegmentCorrupt:
        return
    assert len(MAGIC) <= result.valid_end <= len(data)
    assert not (sealed and result.torn)
    reencoded = b"".join(encode_frame(*f) for f in result.frames)
    assert MAGIC + reencoded == data[: result.valid_end]


@given(frames_st, st.binary(max_size=60))
def test_valid_frames_followed_by_garbage_keep_the_frames(
    frames: list[Frame], garbage: bytes
) -> None:
    data, _ = encode_all(frames)
    scanner = Scanner(data + garbage)
    seen = []
    try:
        for frame in scanner:
            seen.append(frame)
    except SegmentCorrupt:
        pass
    assert seen[: len(frames)] == frames


# ---- the store ----------------------------------------------------------------------------


def open_store(
    path: Path, max_bytes: int = 1 << 20, preamble: Preamble | None = None
) -> SegmentStore:
    store = SegmentStore(path, max_bytes, preamble)
    store.recover()
    return store


def names(path: Path) -> list[str]:
    return sorted(p.name for p in path.iterdir() if p.name != "LOCK")


def test_append_seal_read(tmp_path: Path) -> None:
    preamble = [(5, 1, b"relation users"), (6, 1, b"relation orders")]
    with open_store(tmp_path, preamble=lambda: preamble) as store:
        assert store.seal() is None
        for i in range(100):
            store.append(100 + i, 0, b"change %d" % i)
        assert store.active_bytes() > 0
        assert names(tmp_path) == ["0000000000000001.active"]
        info = store.seal()
        assert info is not None
        assert info.seq == 1 and info.frames == 100
        assert (info.first_lsn, info.last_lsn) == (Lsn(100), Lsn(199))
        assert info.path == tmp_path / "0000000000000001.sealed"
        assert info.size_bytes == info.path.stat().st_size
        assert names(tmp_path) == ["0000000000000001.sealed"]
        assert store.sealed() == [info]
        assert store.active_bytes() == 0
        assert store.pending_bytes() == info.size_bytes
        appended = [(100 + i, 0, b"change %d" % i) for i in range(100)]
        assert list(store.read(info)) == preamble + appended
        assert store.seal() is None


def test_seal_on_size_and_every_segment_starts_with_the_preamble(tmp_path: Path) -> None:
    relations: list[Frame] = []

    def preamble() -> list[Frame]:
        return list(relations)

    appended: list[Frame] = []
    infos: list[SegmentInfo] = []
    with open_store(tmp_path, max_bytes=4096, preamble=preamble) as store:
        for i in range(500):
            if i % 100 == 0:
                relations.append((i, 1, b"relation %d" % i))
            frame = (1000 + i, 0, os.urandom(50))
            store.append(*frame)
            appended.append(frame)
            if store.should_seal():
                assert store.active_bytes() >= 4096
                info = store.seal()
                assert info is not None
                infos.append(info)
        last = store.seal()
        assert last is not None
        infos.append(last)
        assert store.sealed() == infos
        assert [i.seq for i in infos] == list(range(1, len(infos) + 1))
        assert all(i.size_bytes < 4096 + HEADER_SIZE + 50 for i in infos)
        got: list[Frame] = []
        for info in infos:
            frames = list(store.read(info))
            n_pre = len(frames) - info.frames
            assert frames[:n_pre] == [f for f in frames if f[2].startswith(b"relation")]
            assert n_pre >= 1  # the first relation existed before the first append
            assert frames[n_pre][0] == info.first_lsn and frames[-1][0] == info.last_lsn
            got.extend(frames[n_pre:])
        assert got == appended
        assert store.pending_bytes() == sum(i.size_bytes for i in infos)


def test_reserved_kind_is_refused(tmp_path: Path) -> None:
    with open_store(tmp_path) as store:
        with pytest.raises(ValueError, match="reserved"):
            store.append(1, KIND_PREAMBLE_END, b"")
        assert store.active_bytes() == 0
    with open_store(tmp_path, preamble=lambda: [(1, KIND_PREAMBLE_END, b"")]) as store:
        with pytest.raises(ValueError, match="reserved"):
            store.append(1, 0, b"")


def test_must_recover_first(tmp_path: Path) -> None:
    store = SegmentStore(tmp_path, 1 << 20)
    with pytest.raises(RuntimeError, match="recover"):
        store.append(1, 0, b"x")
    store.close()


def test_recover_after_crash_seals_exactly_the_flushed_frames(tmp_path: Path) -> None:
    store = open_store(tmp_path, preamble=lambda: [(1, 1, b"rel")])
    flushed = [(10 + i, 0, b"row %d" % i) for i in range(50)]
    for frame in flushed:
        store.append(*frame)
    store.flush()
    store.append(99, 0, b"never flushed")
    del store  # a crash: no seal, no close

    with SegmentStore(tmp_path, 1 << 20) as again:
        report = again.recover()
        assert report.sealed_segments == 1
        assert report.frames == 50
        assert report.dropped_bytes == 0
        assert report.max_lsn == Lsn(59)
        assert report.recovered_active == tmp_path / "0000000000000001.sealed"
        assert "1 sealed segment" in report.summary()
        [info] = again.sealed()
        assert list(again.read(info)) == [(1, 1, b"rel")] + flushed
        assert (info.first_lsn, info.last_lsn, info.frames) == (10, 59, 50)
        # New appends go to a new segment after the recovered one.
        again.append(100, 0, b"new")
        assert names(tmp_path) == ["0000000000000001.sealed", "0000000000000002.active"]


def test_recover_after_a_real_crash_in_a_subprocess(tmp_path: Path) -> None:
    script = textwrap.dedent(
        f"""
        import os
        from pathlib import Path
        from walberg.buffer.store import SegmentStore
        store = SegmentStore(Path({str(tmp_path)!r}), 1 << 30, lambda: [(0, 1, b"rel")])
        store.recover()
        for i in range(1000):
            store.append(i, 0, b"%d" % i)
        store.flush()
        # About 2.5 MiB more, so some of it reaches the file unflushed.
        for i in range(1000, 1000 + 2500):
            store.append(i, 0, bytes(1000))
        os._exit(0)
        """
    )
    run_python(script)
    with SegmentStore(tmp_path, 1 << 20) as store:
        report = store.recover()
        [info] = store.sealed()
        frames = list(store.read(info))
        assert frames[0] == (0, 1, b"rel")
        assert 1000 <= info.frames == report.frames == len(frames) - 1
        assert frames[1:1001] == [(i, 0, b"%d" % i) for i in range(1000)]
        assert [f[0] for f in frames[1:]] == list(range(info.frames))


def active_file_with(tmp_path: Path, frames: list[Frame]) -> tuple[bytes, list[int]]:
    """Write frames through a store, leave them in an active file; return its bytes and the
    offset of each appended frame."""
    with open_store(tmp_path / "src", preamble=lambda: [(1, 1, b"rel")]) as store:
        offsets = []
        for frame in frames:
            store.append(*frame)
            offsets.append(store.active_bytes() - len(encode_frame(*frame)))
    [active] = (tmp_path / "src").glob("*.active")
    return active.read_bytes(), offsets


def test_recover_truncates_a_torn_tail_at_every_cut(tmp_path: Path) -> None:
    frames = [(10, 0, b"one"), (11, 0, b"two"), (12, 0, b"three-three")]
    data, offsets = active_file_with(tmp_path, frames)
    last = offsets[-1]
    for cut in range(last + 1, len(data)):
        d = tmp_path / f"cut{cut}"
        d.mkdir()
        (d / "0000000000000007.active").write_bytes(data[:cut])
        with SegmentStore(d, 1 << 20) as store:
            report = store.recover()
            assert report.dropped_bytes == cut - last
            assert report.frames == 2
            [info] = store.sealed()
            assert info.seq == 7 and info.size_bytes == last
            assert list(store.read(info)) == [(1, 1, b"rel")] + frames[:2]
        assert names(d) == ["0000000000000007.sealed"]


def test_recover_treats_garbage_last_frame_of_active_as_torn(tmp_path: Path) -> None:
    frames = [(10, 0, b"one"), (11, 0, b"two")]
    data, offsets = active_file_with(tmp_path, frames)
    damaged = bytearray(data)
    damaged[-1] ^= 0xFF
    (tmp_path / "0000000000000001.active").write_bytes(bytes(damaged) + bytes(4096))
    with SegmentStore(tmp_path, 1 << 20) as store:
        report = store.recover()
        assert report.frames == 1
        assert report.dropped_bytes == len(data) - offsets[1] + 4096
        assert list(store.read(store.sealed()[0]))[1:] == frames[:1]


def test_active_file_with_only_a_preamble_is_deleted(tmp_path: Path) -> None:
    data, offsets = active_file_with(tmp_path, [(10, 0, b"one")])
    d = tmp_path / "store"
    d.mkdir()
    (d / "0000000000000003.active").write_bytes(data[: offsets[0] + 5])
    (d / "0000000000000004.active.tmp").write_bytes(b"half a preamble")
    (d / "0000000000000005.active").write_bytes(MAGIC[:3])
    with SegmentStore(d, 1 << 20) as store:
        report = store.recover()
        assert (report.sealed_segments, report.frames, report.max_lsn) == (0, 0, Lsn(1))
        assert report.dropped_bytes == 5 + 3
        assert len(report.removed_files) == 3
        assert names(d) == []
        store.append(1, 0, b"x")
        assert names(d) == ["0000000000000006.active"]


def test_bit_flip_in_a_sealed_middle_frame_names_the_file(tmp_path: Path) -> None:
    with open_store(tmp_path) as store:
        for i in range(3):
            store.append(i, 0, b"payload %d" % i)
        info = store.seal()
        assert info is not None
        store.append(3, 0, b"in the next segment")
    data = bytearray(info.path.read_bytes())
    middle = len(MAGIC) + HEADER_SIZE + len(encode_frame(0, 0, b"payload 0"))
    data[middle + HEADER_SIZE + 2] ^= 0x04
    info.path.write_bytes(bytes(data))

    with SegmentStore(tmp_path, 1 << 20) as store:
        with pytest.raises(SegmentCorrupt) as caught:
            store.recover()
        message = str(caught.value)
        assert str(info.path) in message
        assert f"byte offset {middle}" in message
        assert "delete this file and everything after it" in message
        assert "re-reads those changes from the replication slot" in message
        assert isinstance(caught.value, Terminal)
        # read() checks the same way, when reached before recover() on a known segment.
        with pytest.raises(SegmentCorrupt, match=info.path.name):
            list(store.read(info))


def test_truncated_sealed_file_is_corrupt(tmp_path: Path) -> None:
    with open_store(tmp_path) as store:
        store.append(1, 0, b"abc")
        info = store.seal()
        assert info is not None
    info.path.write_bytes(info.path.read_bytes()[:-1])
    with SegmentStore(tmp_path, 1 << 20) as store:
        with pytest.raises(SegmentCorrupt, match="truncated"):
            store.recover()


def test_read_streams_a_large_segment(tmp_path: Path) -> None:
    big = os.urandom(2 * 1024 * 1024)
    with open_store(tmp_path, max_bytes=8 << 20) as store:
        for i in range(3):
            store.append(i, 0, big)
        store.append(3, 0, b"")
        info = store.seal()
        assert info is not None
        it = store.read(info)
        assert isinstance(it, Generator)
        assert next(it) == (0, 0, big)
        it.close()  # abandoning the iterator must release the map cleanly
        assert [f[0] for f in store.read(info)] == [0, 1, 2, 3]


def test_remove(tmp_path: Path) -> None:
    with open_store(tmp_path, max_bytes=100) as store:
        infos = []
        for i in range(3):
            store.append(i, 0, b"x" * 200)
            info = store.seal()
            assert info is not None
            infos.append(info)
        store.append(9, 0, b"active")
        store.remove(infos[:2])
        assert not infos[0].path.exists() and not infos[1].path.exists()
        assert store.sealed() == infos[2:]
        assert store.pending_bytes() == infos[2].size_bytes + store.active_bytes()
        with pytest.raises(ValueError, match="not sealed segments"):
            store.remove(infos[:1])
        store.remove([])
    with SegmentStore(tmp_path, 100) as store:
        report = store.recover()
        assert report.sealed_segments == 2  # the third and the formerly active one
        assert [i.seq for i in store.sealed()] == [3, 4]


def test_sizes_and_age(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    clock = [1000.0]

    class FakeTime:
        @staticmethod
        def monotonic() -> float:
            return clock[0]

    monkeypatch.setattr(store_mod, "time", FakeTime)
    with open_store(tmp_path) as store:
        assert store.active_age_seconds() == 0.0
        assert (store.active_bytes(), store.pending_bytes()) == (0, 0)
        store.append(1, 0, b"abc")
        clock[0] += 2.5
        store.append(2, 0, b"def")
        assert store.active_age_seconds() == 2.5
        size = len(MAGIC) + HEADER_SIZE + 2 * (HEADER_SIZE + 3)
        assert store.active_bytes() == store.pending_bytes() == size
        store.flush()
        assert (tmp_path / "0000000000000001.active").stat().st_size == size
        store.seal()
        assert store.active_age_seconds() == 0.0


def test_buffer_is_written_out_past_a_megabyte(tmp_path: Path) -> None:
    with open_store(tmp_path, max_bytes=64 << 20) as store:
        path = tmp_path / "0000000000000001.active"
        store.append(1, 0, b"small")
        small = path.stat().st_size
        for i in range(300):
            store.append(2 + i, 0, bytes(4000))
        assert path.stat().st_size > small + (1 << 20) - 4100
        assert store.active_bytes() - path.stat().st_size < (1 << 20)


# ---- lock and errors ----------------------------------------------------------------------


def run_python(script: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=str(SRC))
    return subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=60
    )


def test_lock_refuses_a_second_store(tmp_path: Path) -> None:
    with SegmentStore(tmp_path, 1 << 20):
        with pytest.raises(Terminal) as caught:
            SegmentStore(tmp_path, 1 << 20)
        assert str(tmp_path) in str(caught.value)
        assert f"pid {os.getpid()}" in str(caught.value)

        result = run_python(
            textwrap.dedent(
                f"""
                from pathlib import Path
                from walberg.buffer.store import SegmentStore
                from walberg.errors import Terminal
                try:
                    SegmentStore(Path({str(tmp_path)!r}), 1 << 20)
                except Terminal as exc:
                    print(exc)
                else:
                    print("NOT LOCKED")
                """
            )
        )
        assert "NOT LOCKED" not in result.stdout, result.stderr
        assert f"pid {os.getpid()}" in result.stdout, result.stderr
    # Released on close: a new store can take it.
    SegmentStore(tmp_path, 1 << 20).close()


def test_lock_is_released_when_the_holder_dies(tmp_path: Path) -> None:
    result = run_python(
        f"import os; from pathlib import Path; from walberg.buffer.store import SegmentStore\n"
        f"SegmentStore(Path({str(tmp_path)!r}), 1 << 20); os._exit(0)"
    )
    assert result.returncode == 0, result.stderr
    SegmentStore(tmp_path, 1 << 20).close()


def test_directory_under_a_regular_file_is_a_readable_terminal_error(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    target = blocker / "segments"
    with pytest.raises(Terminal) as caught:
        SegmentStore(target, 1 << 20)
    message = str(caught.value)
    assert str(target) in message
    assert "ENOTDIR" in message or "Not a directory" in message
    assert "writable" in message


@pytest.mark.skipif(os.geteuid() == 0, reason="root ignores directory permissions")
def test_unwritable_directory_is_a_readable_terminal_error(tmp_path: Path) -> None:
    tmp_path.chmod(0o500)
    try:
        with pytest.raises(Terminal, match="Permission denied"):
            SegmentStore(tmp_path / "segments", 1 << 20)
    finally:
        tmp_path.chmod(0o700)


def test_write_failure_stops_the_store_and_recovery_cleans_up(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = open_store(tmp_path)
    for i in range(10):
        store.append(i, 0, b"ok")
    store.flush()

    real_write = os.write

    def disk_full(fd: int, data: bytes) -> int:
        real_write(fd, bytes(data)[:7])  # part of it lands, like a real short write
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "write", disk_full)
    store.append(10, 0, b"lost")
    with pytest.raises(Terminal) as caught:
        store.flush()
    assert str(tmp_path) in str(caught.value)
    assert "ENOSPC" in str(caught.value)
    monkeypatch.setattr(os, "write", real_write)
    with pytest.raises(Terminal, match="earlier error"):
        store.append(11, 0, b"refused")
    with pytest.raises(Terminal):
        store.seal()
    store.close()  # releases the lock without trying to flush again

    with SegmentStore(tmp_path, 1 << 20) as again:
        report = again.recover()
        assert (report.frames, report.dropped_bytes) == (10, 7)
        assert [f[0] for f in again.read(again.sealed()[0])] == list(range(10))


def test_errors_are_walberg_errors() -> None:
    assert issubclass(FrameCorrupt, SegmentCorrupt)
    assert issubclass(SegmentCorrupt, WalbergError)
