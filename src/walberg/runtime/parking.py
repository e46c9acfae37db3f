"""Parked tables: a table that cannot follow its source (a schema change Iceberg cannot
express, a lost key, an ALTER TABLE amid a transaction's changes, a new column of a type
walberg cannot map) stops alone. Its changes are held for it (the slot is confirmed no further
than its last commit, see RunState.confirmable) while every other table goes on, run after
run, until the way out is taken.

A park is durable: a table property of the Iceberg table (``walberg.parked``, or
``walberg.parked.<source>`` in a table shared by several sources) says why, what the table
held, and the pipeline-file settings that decided it. A later run skips the table from its
start, says so, and ends ``--once`` with exit code 3. The park is lifted when its reason is
gone: the table is copied again (``walberg resync``: the copy is a commit past the parked
position), dropped, or the settings that refused the change (``schema_evolution``,
``text_types``) are changed, in which case the table is tried again."""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from typing import Callable, Optional

from walberg import metrics
from walberg.apply.iceberg import IcebergSink
from walberg.config import Config
from walberg.runtime.state import RunState

log = logging.getLogger("walberg")

PARK_PROPERTY = "walberg.parked"


@dataclass(frozen=True)
class Park:
    why: str
    held: Optional[str]  # the LSN the table held when it was parked ("" none)
    settings: str  # the pipeline-file settings that decided it, as JSON
    since: float  # unix time

    def to_json(self) -> str:
        return json.dumps({"why": self.why, "held": self.held, "settings": self.settings,
                           "since": round(self.since, 3)}, sort_keys=True)

    @staticmethod
    def from_json(text: str) -> Optional["Park"]:
        try:
            raw = json.loads(text)
            return Park(str(raw["why"]), raw.get("held"), str(raw.get("settings", "")),
                        float(raw.get("since", 0)))
        except (ValueError, TypeError, KeyError, AttributeError):
            return None  # (not walberg's)


def park_property(source_name: Optional[str]) -> str:
    """The property key: per source in a table shared by several."""
    return PARK_PROPERTY if source_name is None else f"{PARK_PROPERTY}.{source_name}"


def parked_why(properties: dict[str, str], source_name: Optional[str] = None) -> Optional[str]:
    """Why the table is parked, from its properties (None: it is not)."""
    value = properties.get(park_property(source_name))
    park = Park.from_json(value) if value else None
    return park.why if park is not None else None


class Parking:
    """Parks tables and reads the parks back; the applier and the stager park through it."""

    def __init__(self, config: Config, state: RunState, targets: dict[str, str],
                 sink: Callable[[], IcebergSink]) -> None:
        self.config = config
        self.state = state
        self.targets = targets
        self._sink = sink
        self._written: set[str] = set()  # parks this run has recorded in the lake

    def _settings(self, table: str) -> str:
        layout = self.config.layout_for(table)
        return json.dumps({"schema_evolution": layout.schema_evolution,
                           "text_types": sorted(self.config.sink.text_types)}, sort_keys=True)

    def _key(self) -> str:
        return park_property(self._sink().source)

    def park(self, table: str, why: str) -> None:
        """Stop ``table`` alone (the others go on); recorded in the lake by ``record``."""
        if self.state.is_halted(table):
            return
        self.state.halt(table, why)
        metrics.TABLE_STOPPED.labels(table).set(1)
        log.error("%s The table is parked: its changes are held for it (the replication slot "
                  "keeps them from LSN %s on) while the other tables go on.", why,
                  self.state.committed_at(table) or "-")

    def record(self) -> None:
        """Write the parks of this run that the lake does not hold yet (from the applier's
        thread: a park found while staging is recorded before the batch commits)."""
        for table, why in self.state.halted().items():
            if table in self._written:
                continue
            held = self.state.committed_at(table)
            park = Park(why, str(held) if held is not None else None, self._settings(table),
                        time.time())
            self._sink().set_property(self.targets[table], self._key(), park.to_json())
            self._written.add(table)

    def load(self, tables: list[str]) -> None:
        """At the start, once the lake is read: the tables parked by an earlier run are
        parked again, unless their reason is gone (then the park is lifted and said)."""
        sink = self._sink()
        key = self._key()
        for table in tables:
            target = self.targets[table]
            if not sink.known_to_exist(target):
                continue
            value = sink.properties(target, key).get(key)
            if not value:
                continue
            park = Park.from_json(value)
            held = self.state.committed_at(table)
            if park is None:
                lifted = "its record is not walberg's"
            elif park.held != (str(held) if held is not None else None):
                lifted = (f"it was copied again since (it held LSN {park.held or '-'} when "
                          f"parked, LSN {held or '-'} now)")
            elif park.settings != self._settings(table):
                lifted = "the pipeline file's settings that refused it changed: tried again"
            else:
                self.state.halt(table, park.why)
                self._written.add(table)
                metrics.TABLE_STOPPED.labels(table).set(1)
                log.error("%s is parked (since %s): %s Its changes are held for it while the "
                          "other tables go on.", table,
                          time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(park.since)),
                          park.why)
                continue
            self.lift(table, lifted)

    def lift(self, table: str, why: str) -> None:
        """The table follows its source again (copied again, or its settings changed)."""
        sink = self._sink()
        target = self.targets[table]
        if sink.table_exists(target) and sink.properties(target, self._key()).get(self._key()):
            sink.set_property(target, self._key(), None)
            log.warning("%s is no longer parked: %s", table, why)
        self.state.unhalt(table)
        self._written.discard(table)
        metrics.TABLE_STOPPED.labels(table).set(0)
