"""State has one owner: a Request's fields change only through its named transitions
(control/request.py), and its block table only through its lane's BlockPool (control/blocks.py).

Read from the source (an assignment, augmented assignment or mutating call on an attribute named
like a Request field, on anything but `self` outside request.py), so a new writer anywhere in the
control plane fails here and must become a transition instead.
"""
from __future__ import annotations

import ast
from pathlib import Path

import ttserve.control

CONTROL = Path(ttserve.control.__file__).parent
# The protobuf edges build messages whose fields share names with Request's (prompt_token_ids,
# error, ...); they construct Requests but never assign to one.
EDGES = {"wire.py", "server.py"}
BLOCK_TABLE = {"block_tables", "num_skipped_blocks", "num_published_blocks"}
MUTATING = {"append", "extend", "clear", "pop", "remove", "insert"}


def request_fields() -> set[str]:
    tree = ast.parse((CONTROL / "request.py").read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Request")
    return {n.target.id for n in cls.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}


def writers(source: str, module: str, fields: set[str]) -> list[tuple[str, str, int]]:
    """(field, enclosing class.function, line) of every write to a Request-named attribute."""
    found: list[tuple[str, str, int]] = []

    class Visitor(ast.NodeVisitor):
        def __init__(self) -> None:
            self.scope: list[str] = []

        def _scoped(self, node: ast.AST) -> None:
            self.scope.append(node.name)  # type: ignore[attr-defined]
            self.generic_visit(node)
            self.scope.pop()

        visit_FunctionDef = visit_AsyncFunctionDef = visit_ClassDef = _scoped

        def _target(self, target: ast.expr, line: int) -> None:
            if isinstance(target, ast.Tuple):
                for element in target.elts:
                    self._target(element, line)
            elif isinstance(target, ast.Attribute) and target.attr in fields:
                on_self = isinstance(target.value, ast.Name) and target.value.id == "self"
                if not on_self or module == "request.py":
                    found.append((target.attr, ".".join(self.scope[-2:]), line))

        def visit_Assign(self, node: ast.Assign) -> None:
            for target in node.targets:
                self._target(target, node.lineno)
            self.generic_visit(node)

        def visit_AugAssign(self, node: ast.AugAssign) -> None:
            self._target(node.target, node.lineno)
            self.generic_visit(node)

        def visit_Call(self, node: ast.Call) -> None:
            func = node.func
            if isinstance(func, ast.Attribute) and func.attr in MUTATING:
                self._target(func.value, node.lineno)
            self.generic_visit(node)

    Visitor().visit(ast.parse(source))
    return found


def test_request_fields_are_written_only_by_their_transitions_and_block_tables_only_by_the_pool():
    fields = request_fields()
    wrong = []
    for path in sorted(CONTROL.glob("*.py")):
        if path.name in EDGES:
            continue
        for field, where, line in writers(path.read_text(), path.name, fields):
            owner = "blocks.py" if field in BLOCK_TABLE else "request.py"
            if path.name != owner or (owner == "request.py" and not where.startswith("Request.")):
                wrong.append(f"{path.name}:{line} {where} writes Request.{field} (its writer: {owner})")
    assert not wrong, "\n".join(wrong)


def test_the_ownership_check_sees_a_write_outside_the_transitions():
    fields = request_fields()
    source = ("def f(request, r):\n    request.slot = 3\n    r.output_token_ids.append(1)\n"
              "    request.num_preemptions += 1\n    self.lane = 2\n")
    assert [(f, line) for f, _, line in writers(source, "scheduler.py", fields)] == [
        ("slot", 2), ("output_token_ids", 3), ("num_preemptions", 4)]
