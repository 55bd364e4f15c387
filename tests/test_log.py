"""Structured key=value log lines, level from ELASTICD_LOG_LEVEL."""

from __future__ import annotations

import io
import logging
import sys

from elasticd.log import kv, level_from_env, setup_logging


def test_log_lines_are_key_value_with_quoted_messages_and_extra_fields():
    stream = io.StringIO()
    setup_logging(stream, env={"ELASTICD_LOG_LEVEL": "debug"})
    logging.getLogger("elasticd.test").info("round closed", **kv(round=3, members="a b"))
    line = stream.getvalue().strip()
    assert line.startswith("ts=") and line.endswith('round=3 members="a b"')
    assert ' level=info logger=elasticd.test msg="round closed" ' in line


def test_setting_up_twice_does_not_duplicate_lines():
    stream = io.StringIO()
    setup_logging(stream, env={})
    setup_logging(stream, env={})
    logging.getLogger("trainer.x").warning("once")
    assert stream.getvalue().count("msg=once") == 1


def test_the_level_comes_from_the_environment_and_defaults_to_info():
    assert level_from_env({"ELASTICD_LOG_LEVEL": "WARNING"}) == logging.WARNING
    assert level_from_env({}) == logging.INFO
    assert level_from_env({"ELASTICD_LOG_LEVEL": "nonsense"}) == logging.INFO
    stream = io.StringIO()
    setup_logging(stream, env={"ELASTICD_LOG_LEVEL": "error"})
    logging.getLogger("checkpoint.y").warning("hidden")
    assert stream.getvalue() == ""


def test_an_unknown_level_is_said_once_and_info_is_used():
    """A typo fell back to info in silence (a newcomer's walk)."""
    stream = io.StringIO()
    setup_logging(stream, env={"ELASTICD_LOG_LEVEL": "verbose"})
    said = stream.getvalue()
    assert said.count("\n") == 1 and "ELASTICD_LOG_LEVEL='verbose' is not a level" in said, said
    logging.getLogger("elasticd.z").info("shown")
    assert "msg=shown" in stream.getvalue()
    quiet = io.StringIO()
    setup_logging(quiet, env={"ELASTICD_LOG_LEVEL": " Warning "})
    assert quiet.getvalue() == ""


def test_without_a_stream_lines_go_to_stderr_as_it_is_at_each_line(monkeypatch, capsys):
    """pytest replaces sys.stderr for each test and closes the old one: a handler bound to
    the stderr of its install wrote ``--- Logging error --- ValueError: I/O operation on
    closed file`` into later tests' output instead of the line."""
    first = io.StringIO()
    monkeypatch.setattr(sys, "stderr", first)
    setup_logging(env={})
    logging.getLogger("elasticd.etcd").info("etcd started")
    assert 'msg="etcd started"' in first.getvalue()
    first.close()
    second = io.StringIO()
    monkeypatch.setattr(sys, "stderr", second)
    logging.getLogger("elasticd.etcd").info("etcd started again")
    assert 'msg="etcd started again"' in second.getvalue(), second.getvalue()
    assert "Logging error" not in second.getvalue() + capsys.readouterr().err
