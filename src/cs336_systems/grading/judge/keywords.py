"""Which cases ``-k EXPR`` selects: pytest's keyword expressions (``and``, ``or``, ``not``, parentheses;
an identifier matches when it is a case-insensitive substring of one of the case's names), evaluated on
the names pytest gives a case's test in ``tests/contract/test_hooks.py``, so that the judging process
selects what ``pytest tests/contract -k EXPR`` selects (``tests/contract/test_judge_module.py`` compares
the two). Written here rather than borrowed from pytest: an installed grader need not have pytest.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable

from ..shared.cases import Case

# The contract test of each family (``tests/contract/test_hooks.py``): its name is in each case's.
FAMILY_TESTS = {
    "attention": "test_attention",
    "ddp": "test_ddp",
    "sharded": "test_sharded_optimizer",
    "fsdp": "test_fsdp",
}
# What pytest adds to every one of those tests' names: its folders and module, and its markers.
TEST_NAMES = ("tests", "contract", "test_hooks.py", "hook", "tier", "timeout", "parametrize", "xdist_group")
IDENT = re.compile(r"(:?\w|:|\+|-|\.|\[|\]|\\|/)+")  # pytest's identifier
KEYWORDS = ("and", "or", "not")


class KeywordError(ValueError):
    """A ``-k`` expression that does not parse."""


def case_names(case: Case) -> frozenset[str]:
    """The names ``case`` answers to: its test's (``test_ddp[<id>]``), its folders', its markers'."""
    names = {f"{FAMILY_TESTS[case.family]}[{case.id}]", *TEST_NAMES}
    if case.world_size > 1:
        names.add("distributed")
    return frozenset(names)


def _tokens(text: str) -> list[str]:
    found, pos = [], 0
    while pos < len(text):
        if text[pos] in " \t":
            pos += 1
        elif text[pos] in "()":
            found.append(text[pos])
            pos += 1
        elif match := IDENT.match(text, pos):
            found.append(match.group(0))
            pos = match.end()
        else:
            raise KeywordError(f"{text}: at column {pos + 1}: unexpected character {text[pos]!r}")
    return found


class _Parser:
    """expr: and_expr ('or' and_expr)*; and_expr: not_expr ('and' not_expr)*;
    not_expr: 'not' not_expr | '(' expr ')' | identifier. Each rule returns a predicate on the names."""

    def __init__(self, text: str) -> None:
        self.text, self.tokens, self.at = text, _tokens(text), 0

    def _peek(self) -> str | None:
        return self.tokens[self.at] if self.at < len(self.tokens) else None

    def _take(self, token: str) -> bool:
        if self._peek() == token:
            self.at += 1
            return True
        return False

    def _fail(self, wanted: str) -> KeywordError:
        got = self._peek()
        return KeywordError(
            f"{self.text}: expected {wanted}; got {'end of input' if got is None else repr(got)}"
        )

    def parse(self) -> Callable[[Iterable[str]], bool]:
        rule = self._or()
        if self._peek() is not None:
            raise self._fail("'and', 'or' or the end")
        return rule

    def _or(self) -> Callable[[Iterable[str]], bool]:
        rules = [self._and()]
        while self._take("or"):
            rules.append(self._and())
        return lambda names: any(rule(names) for rule in rules)

    def _and(self) -> Callable[[Iterable[str]], bool]:
        rules = [self._not()]
        while self._take("and"):
            rules.append(self._not())
        return lambda names: all(rule(names) for rule in rules)

    def _not(self) -> Callable[[Iterable[str]], bool]:
        if self._take("not"):
            inner = self._not()
            return lambda names: not inner(names)
        if self._take("("):
            inner = self._or()
            if not self._take(")"):
                raise self._fail("')'")
            return inner
        token = self._peek()
        if token is None or token in (*KEYWORDS, ")"):
            raise self._fail("'not', '(' or an identifier")
        self.at += 1
        if self._peek() == "(":  # pytest reads ident(...) as call parameters, which -k refuses
            raise KeywordError(f"{self.text}: keyword expressions do not support call parameters")
        word = token.lower()
        return lambda names: any(word in name.lower() for name in names)


def matcher(expression: str | None) -> Callable[[Case], bool]:
    """Whether a case is selected by ``expression`` (every case when it is empty, as in pytest)."""
    if not expression or not expression.strip():
        return lambda case: True
    rule = _Parser(expression).parse()
    return lambda case: rule(case_names(case))
