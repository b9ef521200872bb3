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


def test_undo_of_one_owner_leaves_the_others_and_deletes_what_the_owner_did_not_hold():
    first, second = Worker(), Worker()
    patches = PatchSet("test")
    for worker in (first, second):
        patches.replace(worker, "report", lambda before: lambda: "patched " + before())
    assert first.report() == second.report() == "patched report" and patches.patched(first, "report")
    patches.undo(first)
    assert "report" not in vars(first) and first.report() == "report" and not patches.patched(first)
    assert second.report() == "patched report" and patches.active
    patches.undo()
    assert "report" not in vars(second) and second.report() == "report" and not patches.active


def test_undo_leaves_a_name_someone_else_replaced_after_the_set():
    worker = Worker()
    patches = PatchSet("test")
    patches.replace(worker, "report", lambda before: lambda: "ours")
    worker.report = lambda: "theirs"
    patches.undo()
    assert worker.report() == "theirs"


class _Parameter:
    """What zero.Init leaves on a parameter: its three gather closures, instance attributes."""

    def __init__(self):
        self.calls = []
        self.all_gather = lambda *args, **kwargs: self.calls.append("all_gather")
        self.all_gather_coalesced = lambda *args, **kwargs: self.calls.append("all_gather_coalesced")
        self.partition = lambda **kwargs: self.calls.append(("partition", kwargs["has_been_updated"]))


class _Runtime:
    def __init__(self):
        self.rewritten = []

    def windows_rewritten(self, what):
        self.rewritten.append(what)


class _Coordinator:
    def reset_step(self):
        return "reset"


def test_pulls_and_the_trace_gate_are_replaced_through_patch_sets_and_put_back_exactly():
    from deepspeed.runtime.zero import partitioned_param_coordinator as ppc

    from ds_odc.integration.zero3_params import install_pulls, restore_trace_checks, skip_trace_checks, uninstall_pulls

    params = [_Parameter() for _ in range(3)]
    zero3 = [(p.all_gather, p.all_gather_coalesced, p.partition) for p in params]
    first, second = _Runtime(), _Runtime()
    install_pulls(first, params)
    install_pulls(second, params)  # the same parameters wrapped again: the newest engine's pulls
    params[0].partition(has_been_updated=True)
    assert params[0].calls == [("partition", True)], "ZeRO-3's own partition runs once, not through the first's"
    assert second.rewritten and not first.rewritten
    uninstall_pulls(params)
    assert [(p.all_gather, p.all_gather_coalesced, p.partition) for p in params] == zero3

    gate, coordinators = ppc.assert_ints_same_as_other_ranks, [_Coordinator(), _Coordinator()]
    for coordinator in coordinators:
        skip_trace_checks(coordinator)
    assert "reset_step" in vars(coordinators[0]) and coordinators[0].reset_step() == "reset"
    assert ppc.assert_ints_same_as_other_ranks is not gate
    restore_trace_checks(coordinators[0])
    assert "reset_step" not in vars(coordinators[0]) and ppc.assert_ints_same_as_other_ranks is not gate
    restore_trace_checks(coordinators[1])
    assert "reset_step" not in vars(coordinators[1]) and ppc.assert_ints_same_as_other_ranks is gate


class _Engine:
    """The surface of a DeepSpeed engine the step recorder hooks into."""

    global_rank, device = 0, "cpu"

    def __init__(self):
        self.optimizer = object()
        self.destroyed = 0

    def forward(self, x):
        return x

    def backward(self, loss):
        return loss

    def step(self):
        return None

    def destroy(self):
        self.destroyed += 1


def test_the_step_recorder_s_hooks_are_undone_by_the_engine_s_destroy():
    from ds_odc.integration.metrics_hooks import attach_recorder

    engine = _Engine()
    recorder = attach_recorder(engine)
    assert {"forward", "backward", "step", "destroy"} <= set(vars(engine))
    assert attach_recorder(engine) is recorder
    engine.destroy()
    assert engine.destroyed == 1 and engine.odc_metrics is recorder, "destroyed once; the reports stay readable"
    assert not {"forward", "backward", "step", "destroy"} & set(vars(engine))


def test_every_file_that_patches_or_changes_the_process_has_a_process_wide_line():
    """A patch goes through patching.py and is listed in PROCESS_WIDE with how long it lasts and why."""
    import os
    import re

    from ds_odc.integration.surface_table import PROCESS_WIDE

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    named = " ".join(entry.where for entry in PROCESS_WIDE)
    effects = re.compile(r"from ds_odc\.integration\.patching import|\bsignal\.signal\(|sys\.excepthook =|"
                         r"atexit\.register\(|sys\.meta_path\.insert\(")
    paths = [os.path.join(folder, name) for folder, _, names in os.walk(os.path.join(root, "ds_odc"))
             for name in names if name.endswith(".py")]
    paths += [os.path.join(root, name) for name in ("ds_odc_autoload.py", "ds_odc_import_hooks.py")]
    patching = []
    for path in paths:
        with open(path) as source:
            if effects.search(source.read()):
                patching.append(os.path.relpath(path, root))
    assert len(patching) >= 10, f"the pattern no longer finds the files known to patch: {patching}"
    unlisted = [path for path in patching if path not in named]
    assert not unlisted, f"add a PROCESS_WIDE line (ds_odc/integration/surface_process_wide.py) for: {unlisted}"
