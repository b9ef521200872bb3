"""The layers import downwards only (config -> adapter -> runtime -> comm -> ops; docs/architecture.md).
Every import counts, those inside functions too: a lazy import upwards is still an arrow upwards."""
import ast
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

#: What each layer may import from ds_odc (a module, or a package and everything under it).
ALLOWED = {
    "comm": ("ds_odc.comm", "ds_odc.errors", "ds_odc.arguments", "ds_odc.ops_builder"),
    "runtime": ("ds_odc.runtime", "ds_odc.comm", "ds_odc.errors", "ds_odc.arguments", "ds_odc.ops_builder"),
}
#: Libraries a DeepSpeed-agnostic layer never imports.
FOREIGN = ("deepspeed", "transformers", "accelerate")


def _imports(path: str) -> list[tuple[int, str]]:
    """(line, module) of every import in a file; ``from x import y`` gives ``x.y`` (y may be a module)."""
    with open(path) as source:
        tree = ast.parse(source.read(), path)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{path}:{node.lineno}: relative import (the house imports absolutely)"
            found += [(node.lineno, f"{node.module}.{alias.name}") for alias in node.names]
    return found


def _within(module: str, allowed: tuple[str, ...]) -> bool:
    return any(module == prefix or module.startswith(prefix + ".") for prefix in allowed)


@pytest.mark.parametrize("layer", sorted(ALLOWED))
def test_a_layer_imports_nothing_above_it(layer):
    folder = os.path.join(ROOT, "ds_odc", layer)
    files = sorted(name for name in os.listdir(folder) if name.endswith(".py"))
    assert len(files) > 3
    upward = []
    for name in files:
        for line, module in _imports(os.path.join(folder, name)):
            top = module.split(".")[0]
            if (top == "ds_odc" and not _within(module, ALLOWED[layer])) or top in FOREIGN:
                upward.append(f"ds_odc/{layer}/{name}:{line} imports {module}")
    assert not upward, "\n".join(upward)


def test_the_check_sees_an_upward_import(tmp_path):
    path = tmp_path / "example.py"
    path.write_text("def late():\n    from ds_odc.integration import engine\n    import deepspeed\n")
    imports = _imports(str(path))
    assert imports == [(2, "ds_odc.integration.engine"), (3, "deepspeed")]
    assert not _within(imports[0][1], ALLOWED["runtime"])


@pytest.mark.parametrize("suite", ["unit", "distributed", "gpu"])
def test_a_test_directory_holds_only_tests(suite):
    """What the tests run (harness, workloads, scripts, transports) lives in tests/support/, apart from them."""
    folder = os.path.join(ROOT, "tests", suite)
    others = sorted(name for name in os.listdir(folder) if name.endswith(".py")
                    and not name.startswith("test_") and name not in ("__init__.py", "conftest.py"))
    assert not others, f"tests/{suite}/ holds helpers {others}: move them to tests/support/"
