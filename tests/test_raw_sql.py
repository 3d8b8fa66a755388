"""Hand-written SQL lives in one package, telemachus/db/ (docs/architecture.md, "Where SQL lives"),
beside the migrations and a short list of named exceptions, each with its reason. Everything else
reaches the database through the ORM or the package's builders, so a statement is never written
twice, once per module that needs it. This fails when SQL text, a raw cursor, `raw()`, `extra()` or
`RawSQL` appears anywhere else."""

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
APPS = ("telemachus", "quotas", "executors", "scheduler")
PACKAGE = "telemachus/db/"

EXCEPTIONS = {
    # The scheduler's two statements that the ORM cannot build at the speed they run (the queue's
    # heads, a per-team top-n UNION ALL; the submit's one-statement admission): the module says
    # why, with measurements.
    "scheduler/core/statements.py",
    # CREATE DATABASE, through the server's maintenance database: Django has no connection to a
    # database that does not exist yet.
    "telemachus/management/commands/database_ensure.py",
    # SQLite's connection options (WAL, synchronous): settings, not a statement the code runs.
    "telemachus/settings.py",
}

KEYWORDS = re.compile(
    r"^\s*(SELECT|INSERT|UPDATE|DELETE|WITH|CREATE|DROP|ALTER|LISTEN|UNLISTEN|NOTIFY|PRAGMA|SET|BEGIN|"
    r"COMMIT|ROLLBACK|TRUNCATE|VACUUM|ANALYZE|LOCK)\s"
)
RAW_CALLS = {"raw", "extra", "RawSQL", "executemany"}
# `x.cursor()` of a database connection (not a relay's cursor, say).
CONNECTIONS = {"connection", "conn", "db", "connections"}


def _docstrings(tree: ast.Module) -> set[int]:
    """The ids of the string nodes that are docstrings."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                found.add(id(first.value))
    return found


def sql_written(source: str) -> list[str]:
    """Each place in `source` that writes SQL or runs it past the ORM: `line: what`."""
    tree = ast.parse(source)
    docstrings = _docstrings(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            if KEYWORDS.match(node.value):
                found.append(f"{node.lineno}: {node.value[:60]!r}")
        elif isinstance(node, ast.Call):
            name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
            if name in RAW_CALLS or (name == "cursor" and _of_connection(node.func)):
                found.append(f"{node.lineno}: {name}(...)")
    return found


def _of_connection(func: ast.expr) -> bool:
    """Whether the call is `connection.cursor()`, `connections[alias].cursor()` and the like."""
    if not isinstance(func, ast.Attribute):
        return False
    owner = func.value.value if isinstance(func.value, ast.Subscript) else func.value
    return isinstance(owner, ast.Name) and owner.id in CONNECTIONS


def modules() -> list[Path]:
    return [
        path
        for app in APPS
        for path in sorted((ROOT / app).rglob("*.py"))
        if "migrations" not in path.parts and not path.relative_to(ROOT).as_posix().startswith(PACKAGE)
    ]


def test_sql_is_written_only_in_the_database_package():
    offenders = {}
    for path in modules():
        name = path.relative_to(ROOT).as_posix()
        if name in EXCEPTIONS:
            continue
        found = sql_written(path.read_text())
        if found:
            offenders[name] = found
    assert offenders == {}, (
        "SQL outside telemachus/db/: build it with the ORM or the package's builders, or move it there "
        f"(or, with a measured reason, name it in EXCEPTIONS): {offenders}"
    )


def test_every_exception_still_writes_sql():
    """An exception that no longer needs to be one is dropped from the list."""
    for name in EXCEPTIONS:
        assert sql_written((ROOT / name).read_text()), f"{name} writes no SQL any more: drop it from EXCEPTIONS"


def test_the_check_finds_what_it_looks_for():
    assert sql_written('x = "SELECT 1"\n') == ["1: 'SELECT 1'"]
    assert sql_written("x = f'UPDATE {t} SET a = 1'\n")
    assert sql_written("with connection.cursor() as c:\n    pass\n") == ["1: cursor(...)"]
    assert sql_written("Job.objects.raw('x')\n") == ["1: raw(...)"]
    assert sql_written("connections['default'].cursor()\n") == ["1: cursor(...)"]
    assert sql_written("relay.cursor(piece)\n") == []
    assert sql_written('def f():\n    """SELECT in a docstring is prose."""\n') == []
    assert sql_written('x = "Selected"\n') == []
