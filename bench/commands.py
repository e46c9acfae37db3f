"""How long a user waits for a read command, each run as a command in a process of its own.

    python bench/commands.py [--rows 100000]

One table is copied into a local hadoop warehouse, then, three times each:
- `walberg --help`: the baseline (Python starts and imports walberg);
- `walberg history`: read from the table's metadata file, no JVM;
- `walberg query` of the same history through Spark (`SELECT ... FROM <table>.history`): what
  `walberg history` cost before it read the metadata file, and what any `walberg query` costs
  (a JVM and a Spark session start; the answer itself is a small part);
- `walberg query --format json` of three rows to standard output.
The figures that matter are the ratios to the baseline, measured in the same run.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import psycopg2

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "bench"))

from backlog import bytecode, walberg_once, write_config  # noqa: E402
from run import save_results, timed  # noqa: E402

from walberg.source.embedded_pg import EmbeddedPostgres  # noqa: E402


def command(*args: str) -> float:
    seconds, proc = timed(lambda: subprocess.run(
        [sys.executable, "-m", "walberg.cli", "-q", *args], capture_output=True, text=True,
        stdin=subprocess.DEVNULL))
    if proc.returncode != 0:
        raise SystemExit(f"walberg {' '.join(args)} failed:\n{proc.stderr[-2000:]}")
    return seconds


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=100_000)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "commands.json"))
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="walberg-commands-"))
    bytecode()  # (as an installed walberg has it)
    server = EmbeddedPostgres().start()
    try:
        conn = psycopg2.connect(server.dsn)
        conn.autocommit = True
        with conn.cursor() as cur:
            cur.execute("CREATE TABLE cmd (id bigint PRIMARY KEY, name text)")
            cur.execute("INSERT INTO cmd SELECT g, 'name ' || g FROM generate_series(1, %s) g",
                        (args.rows,))
        config = str(write_config({"pg": server.dsn}, work, "cmd"))
        walberg_once(Path(config), "copy")
        target = "lake.bench.cmd"
        runs: dict[str, Any] = {
            "help (baseline)": lambda: command("--help"),
            "history (metadata file)": lambda: command("history", "-c", config, "public.cmd"),
            "history through Spark": lambda: command(
                "query", "-c", config, f"SELECT * FROM {target}.history"),
            "query, 3 rows as JSON": lambda: command(
                "query", "-c", config, f"SELECT * FROM {target} ORDER BY id LIMIT 3",
                "--format", "json"),
        }
        results: dict[str, Any] = {}
        for name, run in runs.items():
            times = [run() for _ in range(args.repeat)]
            results[name] = {"seconds": times, "median_s": statistics.median(times)}
    finally:
        server.stop()
    base = results["help (baseline)"]["median_s"]
    for each in results.values():
        each["ratio_to_baseline"] = each["median_s"] / base
    out = save_results(results, args.out)
    print(f"\nread commands, median of {args.repeat} runs each (a process each)")
    for name, each in results.items():
        print(f"  {name:<26} {each['median_s']:>6.2f} s   {each['ratio_to_baseline']:>5.1f}x "
              "the baseline")
    print(f"results: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
