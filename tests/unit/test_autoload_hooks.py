"""``ds_odc_import_hooks`` (post-import hooks on throw-away modules) and ``ds_odc_autoload``'s switch: no torch,
no processes."""
import sys
import textwrap

import pytest

import ds_odc_autoload
import ds_odc_import_hooks


@pytest.fixture
def fresh_module(tmp_path, monkeypatch):
    """A factory of importable modules with unique names, removed again afterwards."""
    monkeypatch.syspath_prepend(str(tmp_path))
    names = []

    def make(name, body="VALUE = 1\n"):
        (tmp_path / f"{name}.py").write_text(textwrap.dedent(body))
        names.append(name)
        return name

    yield make
    for name in names:
        sys.modules.pop(name, None)
        ds_odc_import_hooks._waiting.pop(name, None)


def test_callback_runs_once_after_the_module_has_finished_importing(fresh_module):
    name = fresh_module("odc_hook_target_a", "VALUE = 1\nLAST = 'done'\n")
    seen = []
    ds_odc_import_hooks.when_imported(name, lambda module: seen.append((module.__name__, module.LAST)))
    ds_odc_import_hooks.when_imported(name, seen.append)
    ds_odc_import_hooks.when_imported(name, seen.append)  # the same callback twice: registered once
    assert seen == []
    module = __import__(name)
    assert seen == [(name, "done"), module]
    again = __import__(name)
    assert again is module and len(seen) == 2
    assert module.__spec__.loader.__class__.__name__ == "SourceFileLoader", "the real loader is handed back"


def test_callback_for_an_already_imported_module_runs_at_once(fresh_module):
    module = __import__(fresh_module("odc_hook_target_b"))
    seen = []
    ds_odc_import_hooks.when_imported(module.__name__, seen.append)
    assert seen == [module]


def test_a_failing_callback_warns_and_leaves_the_import_alone(fresh_module):
    name = fresh_module("odc_hook_target_c")

    def broken(module):
        raise RuntimeError("boom")

    ds_odc_import_hooks.when_imported(name, broken)
    with pytest.warns(RuntimeWarning, match=r"odc_hook_target_c.*RuntimeError: boom.*DS_ODC_AUTOLOAD=0"):
        module = __import__(name)
    assert module.VALUE == 1


@pytest.mark.parametrize("value,enabled", [(None, True), ("1", True), ("0", False), ("false", False),
                                           ("OFF", False), (" no ", False)])
def test_the_environment_variable_turns_autoloading_off(monkeypatch, value, enabled):
    if value is None:
        monkeypatch.delenv("DS_ODC_AUTOLOAD", raising=False)
    else:
        monkeypatch.setenv("DS_ODC_AUTOLOAD", value)
    assert ds_odc_autoload.enabled() is enabled
