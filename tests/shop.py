"""Orders and their lines, written in the same source transactions: the workload that shows
whether a reader of the lake ever sees part of a source transaction (tests/test_rest_catalog.py,
bench/atomic_commits.py). Every source transaction keeps each order's total equal to the sum of
its lines' quantities, and every order has LINES lines; a consistent cut of the lake must too."""

from __future__ import annotations

import random
import threading
import time
from typing import Any

import psycopg2

LINES = 3  # each order has this many lines, in every source transaction


def make_shop(pg_conn: Any, unique: str) -> tuple[str, str]:
    orders, lines = f"public.o_{unique}", f"public.l_{unique}"
    with pg_conn.cursor() as cur:
        cur.execute(f"CREATE TABLE {orders} (id bigint PRIMARY KEY, customer text, "
                    "total numeric(12,2) NOT NULL)")
        cur.execute(f"CREATE TABLE {lines} (order_id bigint, n int, qty int NOT NULL, "
                    "PRIMARY KEY (order_id, n))")
        cur.execute(f"INSERT INTO {orders} SELECT g, 'c' || g, {LINES} * g FROM "
                    "generate_series(1, 200) g")
        cur.execute(f"INSERT INTO {lines} SELECT g, k, g FROM generate_series(1, 200) g, "
                    f"generate_series(1, {LINES}) k")
    return orders, lines




def consistent_cut(catalog: Any, orders: str, lines: str) -> tuple[Any, Any]:
    """Both tables as of one moment of the catalog: orders loaded before and after lines, the
    same snapshot both times (a commit moving both pointers lands between two loads or not at
    all, so lines were read at a moment orders held that snapshot)."""
    while True:
        first = catalog.load_table(orders)
        second = catalog.load_table(lines)
        again = catalog.load_table(orders)
        if first.metadata.current_snapshot_id == again.metadata.current_snapshot_id:
            return first, second


def write_shop(dsn: str, orders: str, lines: str, stop: threading.Event,
               counts: dict[str, int], pause: float = 0.005, seed: int = 7,
               first_id: int = 1000) -> None:
    """Source transactions that each keep every order equal to its lines: a new order with its
    lines, an order and its lines changed together, an order and its lines deleted."""
    conn = psycopg2.connect(dsn)
    rng = random.Random(seed)
    next_id = first_id
    live = list(range(1, 201))
    try:
        while not stop.is_set():
            with conn, conn.cursor() as cur:
                kind = rng.random()
                if kind < 0.5 or len(live) < 50:
                    next_id += 1
                    qty = rng.randint(1, 9)
                    cur.execute(f"INSERT INTO {orders} VALUES (%s, 'w', %s)",
                                (next_id, qty * LINES))
                    cur.execute(f"INSERT INTO {lines} SELECT %s, k, %s FROM "
                                f"generate_series(1, {LINES}) k", (next_id, qty))
                    live.append(next_id)
                elif kind < 0.85:
                    order = rng.choice(live)
                    qty = rng.randint(1, 9)
                    cur.execute(f"UPDATE {lines} SET qty = %s WHERE order_id = %s",
                                (qty, order))
                    cur.execute(f"UPDATE {orders} SET total = %s WHERE id = %s",
                                (qty * LINES, order))
                else:
                    order = live.pop(rng.randrange(len(live)))
                    cur.execute(f"DELETE FROM {lines} WHERE order_id = %s", (order,))
                    cur.execute(f"DELETE FROM {orders} WHERE id = %s", (order,))
            counts["transactions"] += 1
            if pause:
                time.sleep(pause)
    finally:
        conn.close()


def half_transactions(orders: Any, lines: Any) -> list[str]:
    """What a consistent cut must never show: an order without its lines (or with lines whose
    quantities do not add up to its total), lines without their order."""
    totals = dict(zip(orders.column("id").to_pylist(),
                      (float(t) for t in orders.column("total").to_pylist()), strict=True))
    sums: dict[int, list[int]] = {}
    for order, qty in zip(lines.column("order_id").to_pylist(), lines.column("qty").to_pylist(),
                          strict=True):
        sums.setdefault(order, []).append(qty)
    problems = [f"order {o} without its lines" for o in totals if o not in sums]
    problems += [f"lines of order {o} without it" for o in sums if o not in totals]
    problems += [f"order {o}: total {totals[o]} but lines {q}" for o, q in sums.items()
                 if o in totals and (len(q) != LINES or sum(q) != totals[o])]
    return problems
