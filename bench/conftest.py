"""Options for the bench suite; fixtures shared with tests live in the root conftest.py.

Subset selection works on parameter names, the same for every bench file: ``--only size=small,xl
--only ctx=256`` keeps the cases whose parameter ``size`` is small or xl and whose ``ctx`` is 256
(cases without such a parameter are kept). ``-k`` on the case ids works too.
"""

from __future__ import annotations

import pytest


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("cs336 bench selection")
    group.addoption(
        "--only",
        action="append",
        default=[],
        metavar="PARAM=V1,V2",
        help="keep only cases whose parameter PARAM takes one of the values (repeatable)",
    )


def _parse_only(values: list[str]) -> dict[str, set[str]]:
    wanted: dict[str, set[str]] = {}
    for value in values:
        key, sep, choices = value.partition("=")
        if not sep or not choices:
            raise pytest.UsageError(f"--only expects PARAM=V1,V2, got {value!r}")
        wanted.setdefault(key.strip(), set()).update(c.strip() for c in choices.split(","))
    return wanted


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    wanted = _parse_only(config.getoption("--only"))
    if not wanted:
        return
    keep, drop = [], []
    for item in items:
        params = getattr(getattr(item, "callspec", None), "params", {})
        ok = all(str(params[k]) in v for k, v in wanted.items() if k in params)
        (keep if ok else drop).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep
