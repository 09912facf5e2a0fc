"""``vmlend.domain`` loads its names lazily (``_EXPORTS`` + ``__getattr__``) and lists the same
names in an ``if TYPE_CHECKING:`` block so that a type checker sees their real types. The two
lists must agree, or mypy checks against a name the run time does not serve (or misses one)."""

import ast
import importlib
import inspect

import vmlend.domain as facade


def _type_checking_imports() -> dict[str, str]:
    tree = ast.parse(inspect.getsource(facade))
    found: dict[str, str] = {}
    for node in tree.body:
        if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING":
            for stmt in node.body:
                assert isinstance(stmt, ast.ImportFrom) and stmt.module
                prefix = f"{facade.__name__}."
                assert stmt.module.startswith(prefix)
                for alias in stmt.names:
                    assert alias.asname is None
                    found[alias.name] = stmt.module.removeprefix(prefix)
    return found


def test_type_checking_block_names_what_getattr_serves() -> None:
    assert _type_checking_imports() == facade._EXPORTS
    assert sorted(facade.__all__) == sorted(facade._EXPORTS)


def test_every_export_lives_where_the_table_says() -> None:
    for name, module in facade._EXPORTS.items():
        loaded = importlib.import_module(f"{facade.__name__}.{module}")
        assert getattr(facade, name) is getattr(loaded, name)
