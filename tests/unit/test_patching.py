"""``ds_odc.integration.patching``: what ``bind`` and ``swapped`` change, and what they leave alone."""
import pytest

from ds_odc.errors import ODCConfigError
from ds_odc.integration.patching import PatchSet, bind, swapped


class Worker:
    def run(self, x):
        return ("run", x)

    def report(self):
        return "report"


def _doubling(original, worker, x):
    return original(worker, x) * 2


def test_bind_changes_one_instance_and_delegates_to_the_class_method():
    mine, other = Worker(), Worker()
    bind(mine, {"run": _doubling}, needed_for="test", release="worker 1.0")
    assert mine.run(3) == ("run", 3, "run", 3)
    assert other.run(3) == ("run", 3) and "run" not in vars(other)
    assert Worker.__dict__["run"] is Worker.run and mine.run.__name__ == "run"


def test_bind_is_all_or_nothing_and_names_every_missing_method_and_the_release():
    worker = Worker()
    with pytest.raises(ODCConfigError) as raised:
        bind(worker, {"run": _doubling, "walk": _doubling}, also_needs=("fly",), needed_for="the option x",
             release="worker 2.0")
    message = str(raised.value)
    assert "the option x needs Worker.walk, Worker.fly" in message and "worker 2.0" in message
    assert "run" not in vars(worker), "nothing is bound when a method is missing"


def test_swapped_restores_what_the_owner_held_and_removes_what_it_did_not():
    worker = Worker()
    with swapped(worker, "report", lambda: "swapped") as original:
        assert worker.report() == "swapped" and original() == "report"
    assert "report" not in vars(worker) and worker.report() == "report"
    worker.label = "a"
    with pytest.raises(RuntimeError), swapped(worker, "label", "b"):
        raise RuntimeError
    assert worker.label == "a"


def test_a_patch_set_replaces_once_and_undo_restores_the_original():
    original = Worker.__dict__["report"]
    patches = PatchSet("test")
    patches.replace(Worker, "report", lambda before: lambda self: "patched " + before(self))
    patches.replace(Worker, "report", lambda before: lambda self: "twice")  # already patched: a no-op
    try:
        assert Worker().report() == "patched report" and patches.original(Worker, "report") is original
    finally:
        patches.undo()
    assert Worker.__dict__["report"] is original and not patches.active
