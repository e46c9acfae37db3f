"""How a table's key becomes the key index's entry: two 64-bit integers, ``key`` (what the index
is sorted and searched by) and ``check`` (compared on every hit).

- One integer-like key (an integer, a date, a timestamp): ``key`` is the value itself,
  ``check`` 0. Exact, and sorted as the table's keys are (Spark can sort a table's rows for
  the index by the key column).
- Two integer-like columns (integers, dates, timestamps), e.g. (tenant_id, id): ``check`` is
  the second value, ``key`` a bijective mix of the first xor a mix of the second. Exact: from
  (key, check) both values come back, so two different keys never share an entry.
- One text column: a value of at most 16 bytes and no NUL is its own bytes, zero-padded to
  16 (exact: text holds no NUL, so the padding cannot be part of it), taken as two words and
  mixed as a pair is; a longer value (or one holding a NUL) is its 128-bit BLAKE2b digest
  with byte 14 set to zero and byte 15 made non-zero, a pattern no padded value has (a zero
  before a non-zero byte), so the two forms never meet, and two long values share an entry
  with a chance of about n^2 / 2^120. Short keys, the common case (codes, slugs, numbers as
  text), are encoded in columns; only long ones are hashed one by one.
- Anything else (composites with text, more than two columns): the 128-bit BLAKE2b digest
  of the key's values (each length-prefixed, so ("ab", "c") and ("a", "bc") differ), split
  in two. Two different keys share both halves with a chance of about n^2 / 2^129: 10^-24
  for ten million keys, far below a disk's undetected error rate.

``key`` alone may repeat for different keys (a 64-bit clash: about one table in 400,000 at
ten million keys); the index detects it by ``check`` and raises ``KeyClash``, and the table
falls back to the MERGE, which is always right. A hit is used only when both halves match.

The same value must give the same entry whether it comes from a staged batch file, a data
file written by walberg on the driver, or one written by Spark: every form a column arrives in
is brought to one canonical form first (integers as int64, dates as days, timestamps as
microseconds since 1970, text as its UTF-8 bytes).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any, Iterable, Optional, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from walberg.apply.types import hex_byte_table

# The Spark SQL types a key column may have, by kind.
_KINDS = {"TINYINT": "int", "SMALLINT": "int", "INT": "int", "BIGINT": "int", "DATE": "date",
          "TIMESTAMP": "ts", "TIMESTAMP_NTZ": "ts", "STRING": "str"}
_INTEGER_LIKE = ("int", "date", "ts")
_WORDS = {"int": 1, "date": 1, "ts": 1, "uuid": 2, "str": 0}
# What a key column is turned into by Spark before its rows come back to the driver (the same
# canonical form the driver gives it): Spark SQL with {} for the quoted column.
_SPARK_FORM = {"int": "CAST({} AS BIGINT)", "date": "CAST(unix_date({}) AS BIGINT)",
               "ts": "unix_micros(CAST({} AS TIMESTAMP))", "str": "{}", "uuid": "{}"}


class ByMerge(Exception):
    """This table's batches cannot go by position (said why): it takes the MERGE."""


class KeyClash(ByMerge):
    """Two different keys share an index entry's ``key`` (see the module docstring): the
    table is applied by MERGE instead."""


class KeyEncodingError(ByMerge):
    """A key value that cannot be encoded (a NULL key): the batch is applied by MERGE."""


@dataclass(frozen=True)
class KeyCodec:
    """The encoding of one table's key: the kind of each key column, in key order."""

    kinds: tuple[str, ...]

    @staticmethod
    def for_types(spark_sql_types: Sequence[str],
                  uuids: Optional[Sequence[bool]] = None) -> Optional["KeyCodec"]:
        """The codec for key columns of these Spark SQL types (``uuids``: which of them hold
        Postgres uuids, as their text); None if one of them has no canonical form here (the
        table is applied by MERGE)."""
        kinds = [_KINDS.get(t.upper()) for t in spark_sql_types]
        for i, is_uuid in enumerate(uuids or ()):
            if is_uuid and kinds[i] == "str":
                kinds[i] = "uuid"
        if not kinds or any(k is None for k in kinds):
            return None
        return KeyCodec(tuple(k for k in kinds if k is not None))

    @property
    def name(self) -> str:
        """What the index records, so that an index made for another key is never read."""
        if self.kinds == ("int",):
            return "int"
        if self.single:
            return f"one:{self.kinds[0]}"
        if self.kinds == ("str",):
            return "short16+blake2b:str"
        return ("pair:" if self.exact else "blake2b-128:") + ",".join(self.kinds)

    @property
    def sorted_like_the_table(self) -> bool:
        """Whether index keys sort as the key column does (one integer key), so that Spark's
        sort by the column is the index's order."""
        return self.single

    @property
    def single(self) -> bool:
        """One integer-like column: the index key is its value."""
        return len(self.kinds) == 1 and self.kinds[0] in _INTEGER_LIKE

    @property
    def exact(self) -> bool:
        """Whether two different keys always differ in (key, check): at most two 64-bit
        words (a uuid is two)."""
        return "str" not in self.kinds and sum(_WORDS[k] for k in self.kinds) <= 2

    def spark_columns(self, quoted: Sequence[str]) -> list[str]:
        """Spark SQL expressions for the key columns (quoted names) in their canonical form."""
        return [_SPARK_FORM[k].format(q) for k, q in zip(self.kinds, quoted, strict=True)]

    def span(self, column: pa.Array | pa.ChunkedArray) -> tuple[Any, Any]:
        """The lowest and highest value of a column of the first key kind, as an Iceberg
        expression on that column takes them (integers for integers, dates and timestamps)."""
        if self.kinds[0] in ("str", "uuid"):
            found = pc.min_max(column)
            return found["min"].as_py(), found["max"].as_py()
        (values,) = _canonical(self.kinds[0], column)
        assert isinstance(values, np.ndarray)
        return int(values.min()), int(values.max())

    def encode(self, columns: Sequence[pa.Array | pa.ChunkedArray]) -> tuple[np.ndarray, np.ndarray]:
        """(key, check) of each row of the key columns, as two int64 arrays."""
        if len(columns) != len(self.kinds):
            raise ValueError(f"a key of {len(self.kinds)} column(s) was given {len(columns)}")
        if self.kinds == ("str",):
            return _pair(*_short_text_words(columns[0]))
        canonical = [word for kind, column in zip(self.kinds, columns, strict=True)
                     for word in _canonical(kind, column)]
        n = len(columns[0])
        if self.single:
            values = canonical[0]
            assert isinstance(values, np.ndarray)
            return values, np.zeros(n, np.int64)
        if self.exact:
            first, second = canonical
            assert isinstance(first, np.ndarray) and isinstance(second, np.ndarray)
            return _pair(first, second)
        return _digests(canonical)


def _canonical(kind: str, column: pa.Array | pa.ChunkedArray) -> list[np.ndarray | pa.Array]:
    """A key column in its canonical form: int64 words (one a value; a uuid's 128 bits are
    two), or the UTF-8 bytes of text (an Arrow binary array)."""
    if isinstance(column, pa.ChunkedArray):
        column = column.combine_chunks()
    if column.null_count:
        raise KeyEncodingError("a key column holds NULL")
    if kind == "str":
        if pa.types.is_integer(column.type):
            raise KeyEncodingError(f"a text key column arrived as {column.type}")
        return [column.cast(pa.binary())]
    if kind == "uuid":
        return list(_uuid_words(column))
    if kind == "ts" and pa.types.is_timestamp(column.type):
        column = pc.cast(column, pa.timestamp("us", column.type.tz))
    elif kind == "date" and pa.types.is_date(column.type):
        column = pc.cast(column, pa.date32()).cast(pa.int32())
    elif not pa.types.is_integer(column.type):
        raise KeyEncodingError(f"a {kind} key column arrived as {column.type}")
    return [np.asarray(column.cast(pa.int64()).to_numpy(zero_copy_only=False), dtype=np.int64)]


_HEX_PAIRS = hex_byte_table("0123456789abcdef")  # a uuid's canonical text: lowercase only


def _uuid_words(column: pa.Array) -> tuple[np.ndarray, np.ndarray]:
    """The two 64-bit halves of each uuid of a column of their canonical text (Postgres's:
    lowercase hex, dashes at 8, 13, 18, 23), parsed without a Python loop. Any other spelling
    is refused (it would be another key in the table, but the same halves)."""
    text = column.cast(pa.binary())
    n = len(text)
    if n == 0:
        return np.empty(0, np.int64), np.empty(0, np.int64)
    offsets = np.frombuffer(text.buffers()[1], np.int32, n + 1, text.offset * 4)
    if not bool(np.all(np.diff(offsets) == 36)):
        raise KeyEncodingError("a uuid key that is not 36 characters long")
    data = np.frombuffer(text.buffers()[2], np.uint8, 36 * n, int(offsets[0])).reshape(n, 36)
    if not bool(np.all(data[:, [8, 13, 18, 23]] == ord("-"))):
        raise KeyEncodingError("a uuid key not in Postgres's spelling")
    # The 32 hex digits (slices, not a gather: a copy at memory speed), then the byte of each
    # two, looked up at once (a third faster than a digit at a time, then shifts).
    digits = np.concatenate([data[:, 0:8], data[:, 9:13], data[:, 14:18], data[:, 19:23],
                             data[:, 24:36]], axis=1)
    values = _HEX_PAIRS[digits.view("<u2")]
    if int(values.max()) == 0xFFFF:
        raise KeyEncodingError("a uuid key not in lowercase hex")
    raw = values.astype(np.uint8)
    words = raw.view(">u8").astype(np.uint64).view(np.int64)
    return words[:, 0].copy(), words[:, 1].copy()


def _pair(first: np.ndarray, second: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(key, check) of two int64 words: ``check`` the second, ``key`` a bijective mix of both
    (so the pair comes back from the entry, and ``key`` spreads even where words repeat)."""
    with np.errstate(over="ignore"):
        key = _mix(first.view(np.uint64)) ^ _mix(second.view(np.uint64) ^ np.uint64(
            0x9E3779B97F4A7C15))
    return key.view(np.int64), second.copy()


def _short_text_words(column: pa.Array | pa.ChunkedArray) -> tuple[np.ndarray, np.ndarray]:
    """The two words of each value of one text key column (see the module docstring): a value
    of at most 16 bytes without NUL, zero-padded; else its marked BLAKE2b digest."""
    (raw,) = _canonical("str", column)
    assert isinstance(raw, pa.Array)
    text = raw.view(pa.string())  # (text's own bytes: a cast would check them as UTF-8 again)
    short = pc.and_(pc.less_equal(pc.binary_length(raw), 16),
                    pc.invert(pc.match_substring(raw, "\x00")))
    if len(raw) == 0 or pc.all(short).as_py():
        words = _padded(text)
    elif not pc.any(short).as_py():
        words = _marked(_blake(raw.to_pylist()))
    else:
        mask = short.to_numpy(zero_copy_only=False)
        words = np.empty((len(raw), 2), "<u8")
        words[mask] = _padded(text.filter(short))
        words[~mask] = _marked(_blake(raw.filter(pc.invert(short)).to_pylist()))
    return words[:, 0].view(np.int64), words[:, 1].view(np.int64)


def _padded(text: pa.Array) -> np.ndarray:
    """Values of at most 16 bytes, zero-padded to 16, as (n, 2) little-endian words. Arrow pads
    by bytes (``ascii_rpad`` counts bytes, whatever the text holds); every value is then
    exactly 16 bytes, read as fixed-size binary without a copy."""
    padded = pc.ascii_rpad(text, width=16, padding="\x00")
    fixed = padded.cast(pa.binary()).cast(pa.binary(16))
    if len(fixed) == 0:
        return np.empty((0, 2), "<u8")
    return np.frombuffer(fixed.buffers()[1], "<u8", 2 * len(fixed),
                         16 * fixed.offset).reshape(-1, 2)


def _marked(digests: np.ndarray) -> np.ndarray:
    """Digests as words no padded value has: byte 14 zero, byte 15 not."""
    out = digests.copy()
    raw = out.view(np.uint8).reshape(-1, 16)
    raw[:, 14] = 0
    raw[:, 15] |= 1
    return out


def _blake(values: Iterable[bytes]) -> np.ndarray:
    """The 128-bit BLAKE2b digest of each value, as (n, 2) little-endian words."""
    blake = hashlib.blake2b
    out = b"".join([blake(v, digest_size=16).digest() for v in values])
    return np.frombuffer(out, "<u8").reshape(-1, 2)


def _mix(x: np.ndarray) -> np.ndarray:
    """A bijection of uint64 that spreads every input bit over the output (murmur3's
    finalizer)."""
    x = x ^ (x >> np.uint64(33))
    x = x * np.uint64(0xFF51AFD7ED558CCD)
    x = x ^ (x >> np.uint64(33))
    x = x * np.uint64(0xC4CEB9FE1A85EC53)
    out: np.ndarray = x ^ (x >> np.uint64(33))
    return out


def _digests(canonical: Sequence[np.ndarray | pa.Array]) -> tuple[np.ndarray, np.ndarray]:
    """(key, check): the halves of the 128-bit BLAKE2b digest of each row's values, each
    length-prefixed (4 bytes, little-endian) if text, 8 little-endian bytes if an integer.
    Each row's bytes are joined by Arrow; only the digest is taken a row at a time."""
    pieces: list[pa.Array] = []
    for values in canonical:
        if isinstance(values, np.ndarray):
            pieces.append(_fixed(values.astype("<i8"), 8))
        else:
            pieces += [_fixed(pc.binary_length(values).to_numpy().astype("<i4"), 4), values]
    rows = pc.binary_join_element_wise(*pieces, b"")
    both = _blake(rows.to_pylist())
    return both[:, 0].astype(np.int64), both[:, 1].astype(np.int64)


def _fixed(words: np.ndarray, width: int) -> pa.Array:
    """Each value's bytes (``width`` of them) as an Arrow binary array."""
    fixed = pa.FixedSizeBinaryArray.from_buffers(pa.binary(width), len(words),
                                                 [None, pa.py_buffer(words.tobytes())])
    return fixed.cast(pa.binary())
