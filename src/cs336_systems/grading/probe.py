"""Which hooks an adapters file implements, read from its source text by the judging process (the file
is parsed, never imported here): a hook is *not implemented* when no top-level statement binds it, or
when it is a function whose body only raises ``NotImplementedError`` (after an optional docstring), the
course's blank template. A file that binds names dynamically (a star import, ``globals().update``,
``exec``) has every hook graded. A hook that raises ``NotImplementedError`` when called is a failure:
nothing the graded process says at run time can turn a hook into "not implemented".
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

from .shared.cases import ATTENTION_HOOKS, TRITON_HOOK

EDITIONS = {
    "1.0.5": (
        ATTENTION_HOOKS["pytorch"],
        TRITON_HOOK,
        "get_ddp_individual_parameters",
        "ddp_individual_parameters_on_after_backward",
        "get_ddp_bucketed",
        "ddp_bucketed_on_after_backward",
        "ddp_bucketed_on_train_batch_start",
        "get_sharded_optimizer",
    ),
    "26.1": (
        ATTENTION_HOOKS["pytorch"],
        TRITON_HOOK,
        "get_ddp",
        "ddp_on_after_backward",
        "get_sharded_optimizer",
        "get_fsdp",
        "fsdp_on_after_backward",
        "fsdp_gather_full_params",
    ),
}
ALL_HOOKS = tuple(dict.fromkeys(h for hooks in EDITIONS.values() for h in hooks))
# The hooks only one edition has: a file that visibly defines one of an edition's own hooks is of that
# edition, and the other edition's own hooks are absent from it even when it also star-imports.
OWN_HOOKS = {
    e: set(hooks) - {h for o, hs in EDITIONS.items() if o != e for h in hs} for e, hooks in EDITIONS.items()
}


@dataclass(frozen=True)
class Probe:
    blank: dict[str, str]  # hook -> why it is not implemented (only the blank ones)
    defined: tuple[str, ...]  # hooks the file binds (or may bind: dynamic files bind every hook)

    def absent(self, hooks: tuple[str, ...]) -> bool:
        """None of ``hooks`` is in the file at all: the other edition's hooks."""
        return not any(h in self.defined for h in hooks)

    def reason(self, hook: str) -> str | None:
        return self.blank.get(hook)


def _statements(body: list[ast.stmt]) -> list[ast.stmt]:
    """Top-level statements, with those inside top-level ``if`` / ``try`` / ``with`` blocks."""
    found = []
    for node in body:
        found.append(node)
        if isinstance(node, ast.If | ast.Try | ast.With):
            inner = [*node.body, *getattr(node, "orelse", []), *getattr(node, "finalbody", [])]
            inner += [s for h in getattr(node, "handlers", []) for s in h.body]
            found += _statements(inner)
    return found


def _bound(node: ast.stmt) -> list[str]:
    if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
        return [node.name]
    if isinstance(node, ast.Import | ast.ImportFrom):
        return [(a.asname or a.name).split(".")[0] for a in node.names]
    targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
    return [t.id for t in targets if isinstance(t, ast.Name)]


def _dynamic(node: ast.stmt) -> bool:
    if isinstance(node, ast.ImportFrom) and any(a.name == "*" for a in node.names):
        return True
    calls = [n for n in ast.walk(node) if isinstance(n, ast.Call)]
    names = {ast.unparse(c.func) for c in calls}
    return bool(names & {"globals().update", "exec", "vars().update", "setattr"})


def _raises_only(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    body = fn.body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]  # the docstring
    if len(body) != 1 or not isinstance(body[0], ast.Raise):
        return False
    exc = body[0].exc
    target = exc.func if isinstance(exc, ast.Call) else exc
    return isinstance(target, ast.Name) and target.id == "NotImplementedError"


def syntax_problem(adapters: Path) -> str | None:
    """Why an adapters file does not parse, as file:line (parsed, never imported), or None."""
    try:
        ast.parse(adapters.read_bytes(), filename=str(adapters))
    except SyntaxError as exc:
        return f"{adapters}:{exc.lineno}: does not parse ({exc.msg})"
    except ValueError as exc:  # null bytes
        return f"{adapters}: does not parse ({exc})"
    return None


def probe(adapters: Path) -> Probe:
    """The file's blank and defined hooks; a file that does not parse has none blank (loading it then
    fails with one line)."""
    try:
        tree = ast.parse(adapters.read_text(), filename=str(adapters))
    except (SyntaxError, ValueError, OSError):
        return Probe({}, ALL_HOOKS)
    statements = _statements(tree.body)
    dynamic = any(_dynamic(n) for n in statements)
    defs = {n.name: n for n in statements if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)}
    bound = {name for n in statements for name in _bound(n)}
    editions = [e for e, own in OWN_HOOKS.items() if own & bound]
    other = (
        {h for e, own in OWN_HOOKS.items() if e not in editions for h in own} if len(editions) == 1 else set()
    )
    blank = {}
    for hook in ALL_HOOKS:
        if hook in defs and _raises_only(defs[hook]):
            blank[hook] = f"{hook}: not implemented (raises NotImplementedError)"
        elif hook not in bound and (not dynamic or hook in other):
            blank[hook] = f"{hook}: not implemented (not defined in {adapters})"
    defined = tuple(h for h in ALL_HOOKS if h in bound or (dynamic and h not in other))
    return Probe(blank, defined)
