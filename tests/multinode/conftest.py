"""Fixtures of the multi-node tests: emulated nodes (``netns.py``) and their clean-up.

Nodes need root, namespaces, veth pairs and a bridge. Whether this machine allows them
is tried once per session; if not, every test here is skipped with the reason, which is
also printed at the end of the run.
"""

from __future__ import annotations

import pytest

from . import netns

_skipped: list[str] = []


@pytest.fixture(scope="session")
def multinode_allowed() -> None:
    reason = netns.probe()
    if reason is not None:
        _skipped.append(reason)
        pytest.skip(reason)


@pytest.fixture
def netem(multinode_allowed) -> None:
    """Skips the test where the kernel has no ``netem`` qdisc (delay, loss)."""
    if not netns.netem_available():
        reason = "no netem qdisc in this kernel (module sch_netem): tests of delay and loss skipped"
        if reason not in _skipped:
            _skipped.append(reason)
        pytest.skip(reason)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    if report.failed:
        item.multinode_failed = True
    return report


@pytest.fixture
def nodes(request, multinode_allowed):
    """``nodes(n, hostnames=None)`` builds ``n`` emulated nodes (a :class:`netns.Nodes`).

    Everything is removed after the test, failed or not; a test that fails has the
    output of every process it ran in its report. Checks that nothing is left behind.
    """
    made: list[netns.Nodes] = []

    def make(n: int, hostnames: list[str] | None = None) -> netns.Nodes:
        made.append(netns.Nodes(n, hostnames))
        return made[-1]

    try:
        yield make
    finally:
        if getattr(request.node, "multinode_failed", False):
            for m in made:
                for proc in m.processes:
                    print(proc.describe())
        for m in made:
            m.close()
    left = [name for m in made for name in m.leftovers()]
    assert not left, f"interfaces left behind: {left}"


def pytest_terminal_summary(terminalreporter):
    for reason in _skipped:
        terminalreporter.write_line(f"tests/multinode skipped: {reason}")
