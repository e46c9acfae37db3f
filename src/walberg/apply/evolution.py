"""Schema evolution: from the Iceberg table's columns and the source's new columns (in pgoutput's
Relation order, which is Postgres's column order), the Iceberg schema changes that make them
match, without rewriting data. A change Iceberg cannot express is refused with the reason.

How the two column lists are read: Postgres appends an added column at the end, keeps a renamed
column in its place, and closes the gap of a dropped one. So, walking both lists in order, a
name present on both sides is the same column; a column that vanished from the old list at the
place where a new name of a compatible type appears is a rename; other vanished columns were
dropped; other new names were added.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional, Sequence

# Type changes Iceberg can make in place (Iceberg's type promotion rules).
_WIDEN = {("int", "bigint"), ("float", "double")}


@dataclass(frozen=True)
class Step:
    kind: str  # add | drop | rename | widen
    name: str
    type: str = ""  # add/widen: the new Spark SQL type
    new_name: str = ""  # rename

    def describe(self) -> str:
        if self.kind == "add":
            return f"add column {self.name} {self.type}"
        if self.kind == "drop":
            return f"drop column {self.name}"
        if self.kind == "rename":
            return f"rename column {self.name} to {self.new_name}"
        return f"widen column {self.name} to {self.type}"


class NotEvolvable(Exception):
    """The change cannot be expressed as an Iceberg schema change."""


def _decimal(t: str) -> Optional[tuple[int, int]]:
    m = re.fullmatch(r"decimal\((\d+),(\d+)\)", t)
    return (int(m.group(1)), int(m.group(2))) if m else None


def widens(old: str, new: str) -> bool:
    """Whether an Iceberg column of type ``old`` can become ``new`` in place."""
    if old == new or (old, new) in _WIDEN:
        return True
    a, b = _decimal(old), _decimal(new)
    return a is not None and b is not None and a[1] == b[1] and b[0] >= a[0]


def plan(current: Sequence[tuple[str, str]], wanted: Sequence[tuple[str, str]]) -> list[Step]:
    """The steps that turn ``current`` (name, type) columns into ``wanted``; types are Spark SQL
    type strings as ``DataType.simpleString()`` prints them. Raises NotEvolvable."""
    old_names = {n for n, _ in current}
    new_names = {n for n, _ in wanted}
    steps: list[Step] = []
    added: Optional[str] = None  # the first column added
    i = j = 0
    while i < len(current) or j < len(wanted):
        if i < len(current) and j < len(wanted):
            (on, ot), (nn, nt) = current[i], wanted[j]
            if added is not None and on == nn:
                # Postgres adds a column at the end: a column met after one added is not the
                # one of that name (or place) before. RENAME price TO price_old, then ADD
                # COLUMN price, reads as "add price_old" by name; which values are whose
                # cannot be told from the names.
                raise NotEvolvable(
                    f"column {nn} comes after the new column {added}, but Postgres adds "
                    f"columns at the end: {nn} is not the column of that name before (a column "
                    "renamed and another added under its old name, say), and the lake cannot "
                    "tell which values are whose")
            if on == nn:
                if ot != nt:
                    if not widens(ot, nt):
                        raise NotEvolvable(
                            f"column {on} changed from {ot} to {nt}, which Iceberg cannot do in "
                            "place (only int -> bigint, float -> double and a decimal's "
                            "precision up)")
                    steps.append(Step("widen", on, nt))
                i, j = i + 1, j + 1
                continue
            if on not in new_names and nn not in old_names and widens(ot, nt):
                steps.append(Step("rename", on, new_name=nn))
                if ot != nt:
                    steps.append(Step("widen", nn, nt))
                i, j = i + 1, j + 1
                continue
            if on not in new_names:
                steps.append(Step("drop", on))
                i += 1
                continue
            if nn not in old_names:
                steps.append(Step("add", nn, nt))
                added = added or nn
                j += 1
                continue
            raise NotEvolvable(f"the columns {on} and {nn} changed places, which Postgres does "
                               "not do by ALTER TABLE")
        if i < len(current):
            steps.append(Step("drop", current[i][0]))
            i += 1
        else:
            steps.append(Step("add", *wanted[j]))
            j += 1
    return steps
