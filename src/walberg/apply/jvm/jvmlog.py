"""Where the JVM's own log goes (a file in walberg's temp folder, or the terminal) and the
log4j2 configuration that sends it there."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Optional

from walberg.apply.jvm.java import temp_folder

# The JVM's own logging (Spark, Hadoop, Iceberg) goes to a file, never to walberg's terminal
# output: walberg turns Java failures into messages of its own. Naming a level for Spark's
# shell logger equal to the root's also keeps Spark from printing its "Setting default log
# level" banner. WALBERG_SPARK_LOG names another file, or "-" for the terminal (what --debug
# does).
_LOG4J = """rootLogger.level = warn
rootLogger.appenderRef.main.ref = main
logger.repl.name = org.apache.spark.repl.Main
logger.repl.level = warn
"""
_LOG4J_FILE = """appender.main.type = RollingFile
appender.main.name = main
appender.main.fileName = {path}
appender.main.filePattern = {path}.%i
appender.main.layout.type = PatternLayout
appender.main.layout.pattern = %d{{yyyy-MM-dd HH:mm:ss}} pid %pid %p %c{{1}}: %m%n
appender.main.policies.type = Policies
appender.main.policies.size.type = SizeBasedTriggeringPolicy
appender.main.policies.size.size = 10MB
appender.main.strategy.type = DefaultRolloverStrategy
appender.main.strategy.max = 2
"""
_LOG4J_CONSOLE = """appender.main.type = Console
appender.main.name = main
appender.main.target = SYSTEM_ERR
appender.main.layout.type = PatternLayout
appender.main.layout.pattern = %d{HH:mm:ss} %p %c{1}: %m%n
"""


def spark_log() -> Optional[Path]:
    """Where the JVM's log goes: a file (default: walberg-spark.log in ``temp_folder``), or
    None for the terminal (WALBERG_SPARK_LOG=-)."""
    chosen = os.environ.get("WALBERG_SPARK_LOG")
    if chosen == "-":
        return None
    if chosen:
        return Path(chosen)
    return temp_folder() / "walberg-spark.log"


def log_config() -> Path:
    """A log4j2 configuration for this process's JVM (see ``_LOG4J``)."""
    target = spark_log()
    folder = temp_folder()
    folder.mkdir(mode=0o700, exist_ok=True)
    if target is None:
        text = _LOG4J + _LOG4J_CONSOLE
    else:
        target.parent.mkdir(parents=True, exist_ok=True)
        text = _LOG4J + _LOG4J_FILE.format(path=target)
    # One file per distinct configuration, shared by every walberg process that uses it.
    conf = folder / f"log4j2-{hashlib.sha1(text.encode()).hexdigest()[:12]}.properties"
    if not conf.exists():
        partial = conf.with_suffix(f".{os.getpid()}")
        partial.write_text(text)
        os.replace(partial, conf)
    return conf
