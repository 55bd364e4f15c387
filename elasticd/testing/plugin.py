"""The pytest plugin of elasticd.testing, registered through the ``pytest11`` entry point.

- ``elasticd_cluster``: a :class:`elasticd.testing.Cluster` for the test, in its own
  temporary directory. At teardown anything a run left running is killed and the run
  directories are deleted, unless the test failed under ``--elasticd-keep`` (then they stay
  and the report says where).
- ``@pytest.mark.elasticd(timeout=S)``: a cluster test. Its runs time out after S seconds
  (default 300), and with pytest-timeout installed the whole test gets S + 120 seconds
  unless it has its own ``timeout`` marker; its runs share that time (each run's timeout
  is cut to what is left, :attr:`elasticd.testing.Cluster.deadline`).
- Reference runs are shared by the whole session (per xdist worker).

Only the standard library and pytest are imported at start-up.
"""

from __future__ import annotations

import os
import time
import types
from collections.abc import Iterator
from typing import Any

import pytest

from elasticd.testing import DEFAULT_TIMEOUT, RUN_OVERHEAD, Cluster, sweep

_REPORTS = pytest.StashKey[dict[str, Any]]()
_GIVEN = pytest.StashKey[float]()
"""The pytest-timeout the plugin gave a test (one without a timeout marker of its own)."""
_STARTED = pytest.StashKey[float]()
"""When the test's setup began (pytest-timeout's clock starts there too)."""
_REFERENCES: dict[str, Any] = {}
TEARDOWN_MARGIN = 120.0
"""Seconds a cluster test gets beyond its runs' timeout (start-up, teardown, assertions)."""


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("elasticd", "elasticd fault-injection tests")
    group.addoption(
        "--elasticd-keep", action="store_true", default=False,
        help="keep the run directories (agent and worker logs, metrics, checkpoints) of "
             "failed elasticd cluster tests, and print where they are",
    )  # fmt: skip


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "elasticd(timeout=300): a test on elasticd local clusters; its runs time out after "
        "`timeout` seconds",
    )


def _timeout(item: pytest.Item) -> float:
    marker = item.get_closest_marker("elasticd")
    if marker is None:
        return DEFAULT_TIMEOUT
    unknown = sorted(set(marker.kwargs) - {"timeout"})
    if unknown or len(marker.args) > 1:
        raise pytest.UsageError(
            f"{item.nodeid}: @pytest.mark.elasticd: takes only timeout= (got "
            f"{', '.join(unknown) or f'{len(marker.args)} positional arguments'})"
        )
    value = marker.kwargs.get("timeout", marker.args[0] if marker.args else DEFAULT_TIMEOUT)
    seconds = _seconds(value)
    if seconds is None:
        raise pytest.UsageError(
            f"{item.nodeid}: @pytest.mark.elasticd(timeout={value!r}): seconds, a number > 0"
        )
    return seconds


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not config.pluginmanager.hasplugin("timeout"):
        return
    for item in items:
        if item.get_closest_marker("elasticd") and not item.get_closest_marker("timeout"):
            item.stash[_GIVEN] = given = _timeout(item) + TEARDOWN_MARGIN
            item.add_marker(pytest.mark.timeout(given))


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    item.stash[_STARTED] = time.monotonic()


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Any:
    if call.excinfo is not None:
        mended = _with_line_numbers(call.excinfo.value)
        if mended is not None:
            call.excinfo = pytest.ExceptionInfo.from_exception(mended)
    report = yield
    item.stash.setdefault(_REPORTS, {})[report.when] = report
    return report


def _with_line_numbers(exc: BaseException) -> BaseException | None:
    """``exc`` (and the exceptions chained to it) with every traceback entry given a line
    number, or None when each has one. A timeout's signal (pytest-timeout's, armed for
    every cluster test, and for every test where ``timeout`` is configured) can land on
    an instruction that has no line, such as an except clause's cleanup; Python 3.11+
    gives that entry ``tb_lineno`` None, and pytest's report of the failure then raises an
    INTERNALERROR that ends the whole session (under xdist, the worker, and the tests
    left to it never run). So this is done for every test: only a report that would have
    failed so changes. The entry is kept, with the line of the last instruction before it
    that has one."""
    changed, seen, cur = False, set(), exc
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        tb = _mended(cur.__traceback__)
        if tb is not None:
            cur.__traceback__, changed = tb, True
        cur = cur.__cause__ or cur.__context__
    return exc if changed else None


def _mended(tb: types.TracebackType | None) -> types.TracebackType | None:
    entries = []
    while tb is not None:
        entries.append(tb)
        tb = tb.tb_next
    if all(e.tb_lineno is not None for e in entries):
        return None
    rebuilt = None
    for e in reversed(entries):
        line = e.tb_lineno
        if line is None:
            code = e.tb_frame.f_code
            line = code.co_firstlineno
            for start, _, at in code.co_lines():
                if start > e.tb_lasti:
                    break
                line = at if at is not None else line
        rebuilt = types.TracebackType(rebuilt, e.tb_frame, e.tb_lasti, line)
    return rebuilt


def _deadline(request: pytest.FixtureRequest) -> float | None:
    """When this test's runs must be over, from now: the pytest-timeout the plugin gave it
    less RUN_OVERHEAD, or the session's (``--timeout``, the ini's) less a quarter of it
    (at most RUN_OVERHEAD). None for a test with a timeout marker of its own (its author
    chose when pytest-timeout ends it) or without pytest-timeout."""
    config, node = request.config, request.node
    if not config.pluginmanager.hasplugin("timeout"):
        return None
    start = node.stash.get(_STARTED, None) or time.monotonic()
    if _GIVEN in node.stash:
        return start + node.stash[_GIVEN] - RUN_OVERHEAD
    if node.get_closest_marker("timeout") is not None:
        return None
    # pytest-timeout's own order: --timeout, then PYTEST_TIMEOUT, then the ini's.
    value = config.getoption("timeout", None)
    if value is None:
        value = os.environ.get("PYTEST_TIMEOUT")
    if value is None:
        value = config.getini("timeout")
    seconds = _seconds(value)
    if seconds is None:
        return None  # none, or 0: pytest-timeout is off
    return start + seconds - min(RUN_OVERHEAD, seconds / 4)


def _seconds(value: Any) -> float | None:
    """``value`` as a number of seconds > 0 (finite), else None."""
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        return None
    return seconds if 0 < seconds < float("inf") else None


def _failed(item: pytest.Item) -> bool:
    reports = item.stash.get(_REPORTS, {})
    return any(r.failed for r in reports.values())


@pytest.fixture(scope="session")
def elasticd_reference_dir(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    """Where the session's reference runs live; deleted at the end of the session (kept
    under --elasticd-keep when a test failed: a failed reference explains many)."""
    path = str(tmp_path_factory.mktemp("elasticd-references"))
    yield path
    keep = request.config.getoption("elasticd_keep") and request.session.testsfailed > 0
    sweep(path, remove=not keep)
    _REFERENCES.clear()
    if keep:
        reporter = request.config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None:
            reporter.write_line(f"elasticd: reference runs kept in {path}")


@pytest.fixture
def elasticd_cluster(
    request: pytest.FixtureRequest, tmp_path: Any, elasticd_reference_dir: str
) -> Iterator[Cluster]:
    """A factory of local clusters (embedded etcd + agents) for this test."""
    base = str(tmp_path / "elasticd")
    os.makedirs(base, exist_ok=True)
    cluster = Cluster(base=base, timeout=_timeout(request.node), references=_REFERENCES,
                      reference_base=elasticd_reference_dir,
                      deadline=_deadline(request))  # fmt: skip
    yield cluster
    failed = _failed(request.node)
    keep = request.config.getoption("elasticd_keep") and failed
    stray = sweep(base, remove=not keep)
    if failed and not keep and cluster.runs:
        # The failure message names run dirs and worker logs: say that they are gone.
        said = ("run directories deleted (the logs its failure names are gone; "
                "--elasticd-keep keeps those of failed tests)")  # fmt: skip
        request.node.add_report_section("teardown", "elasticd", said)
        reporter = request.config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None:
            reporter.write_line(f"elasticd: {request.node.nodeid}: {said}")
    if keep:
        request.node.add_report_section(
            "teardown", "elasticd", f"run directories kept in {base} (--elasticd-keep)"
        )
        reporter = request.config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None:
            reporter.write_line(f"elasticd: {request.node.nodeid}: run directories kept in {base}")
    if stray:
        pytest.fail(f"elasticd: processes left running after the test were killed: {stray}")
