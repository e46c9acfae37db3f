"""walberg's Java helper (apply/jvm/Batch.java): compiled by Spark's Janino in the driver's JVM
once, its class files remembered in walberg's private temp folder and defined from there by
later sessions; a damaged memo, or one somebody else could have written, is compiled anew."""

from __future__ import annotations

import json
import logging
import os
import tempfile
from pathlib import Path
from typing import Any

import pytest

from walberg.apply.jvm import helper


def _fresh_helper(spark: Any, monkeypatch: pytest.MonkeyPatch) -> Any:
    """The helper as a new process would get it (nothing held for this JVM)."""
    monkeypatch.setattr(helper, "_compiled", {})
    return helper.batch_helper(spark)


def _works(spark: Any, made: Any) -> None:
    """``made`` is a working walberg.Batch. Called through Java's reflection: py4j remembers
    a method by its class's name, and in this JVM that name is the session's own helper."""
    jvm, gateway = spark._jvm, spark.sparkContext._gateway
    cls = made.getClass()
    assert str(cls.getName()) == "walberg.Batch"
    types = gateway.new_array(jvm.java.lang.Class, 1)
    types[0] = jvm.java.util.List._java_lang_class
    args = gateway.new_array(jvm.java.lang.Object, 1)
    args[0] = jvm.java.util.ArrayList()
    assert json.loads(cls.getMethod("describe", types).invoke(made, args)) == []


def test_the_helper_is_compiled_once_and_then_defined_from_its_class_files(
        spark: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    helper.batch_helper(spark).list(spark._jvm.java.util.ArrayList())  # the session's own
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    caplog.set_level(logging.DEBUG, logger="walberg")
    folder = tmp_path / f"walberg-{os.getuid()}" / "launch"

    first = _fresh_helper(spark, monkeypatch)
    _works(spark, first)
    assert "Java helper compiled" in caplog.text
    memos = list(folder.glob("helper-*"))
    assert len(memos) == 1
    codes = json.loads(memos[0].read_text())
    assert "walberg.Batch" in codes and len(codes) > 1  # with its inner classes

    # A later session defines it from the class files: nothing compiled.
    caplog.clear()
    second = _fresh_helper(spark, monkeypatch)
    _works(spark, second)
    assert "defined from" in caplog.text and "helper compiled" not in caplog.text
    assert not first.equals(second)

    # Damaged class files: compiled anew, and remembered again.
    memos[0].write_text(json.dumps({name: "AAAA" for name in codes}))
    caplog.clear()
    _works(spark, _fresh_helper(spark, monkeypatch))
    assert "does not load" in caplog.text and "Java helper compiled" in caplog.text
    assert json.loads(memos[0].read_text()) == codes

    # Class files somebody else could have written are never defined.
    memos[0].chmod(0o666)
    caplog.clear()
    _works(spark, _fresh_helper(spark, monkeypatch))
    assert "defined from" not in caplog.text and "Java helper compiled" in caplog.text
