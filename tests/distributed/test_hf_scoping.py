"""ds_odc's Hugging Face behaviour reaches only the jobs that ask for ODC, on any transformers release.

Each test runs ``hf_scoping_script.py`` under torchrun (2 CPU ranks, a tiny Llama) in a fresh interpreter
with the autoload on, and this checkout first on the path (so its ``ds_odc_autoload`` and ``ds_odc`` are
the ones imported, whichever copy is installed):

* a plain ZeRO-3 Trainer run whose ``Trainer`` methods carry sentinels installed before DeepSpeed is
  imported: every sentinel runs, and no attribute of ``Trainer`` or ``transformers.trainer`` is
  replaced; once a config asks for the odc stage, exactly one is (``Trainer.__init__``, a pass-through
  to the installed one), and a plain Trainer built after that still gets nothing bound (an ODC Trainer gets
  ``train`` and ``log``, and the balance methods with the balance block);
* a transformers release without ``Trainer._track_num_input_tokens`` (transformers' own ``trainer.py``
  with the method renamed, its callers included): it imports without a warning, a plain run works, an
  ODC Trainer is built, and an ODC Trainer with a balance block fails naming the release and the method.
"""
import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from tests.support.harness import free_port  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "tests", "support", "hf_scoping_script.py")
BALANCE_METHODS = ["_track_num_input_tokens", "floating_point_ops", "get_batch_samples", "get_train_dataloader",
                   "log", "training_step"]


def _run(mode: str, results_dir) -> tuple[list[dict], str]:
    env = {key: value for key, value in os.environ.items() if key != "DS_ODC_AUTOLOAD"}
    env.update(DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([ROOT, *filter(None, [env.get("PYTHONPATH")])]))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
           SCRIPT, mode, str(results_dir)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, cwd="/")
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-5000:]
    return [json.loads((results_dir / f"rank{rank}.json").read_text()) for rank in range(2)], output


def test_a_plain_zero3_trainer_runs_the_methods_installed_before_deepspeed_untouched(tmp_path):
    results, output = _run("sentinels", tmp_path)
    for rank in results:
        assert not rank["deepspeed_imported_first"] and rank["ds_odc_imported"]
        assert rank["engine"] == "DeepSpeedEngine" and len(rank["losses"]) == 2
        ran = {name for name, count in rank["calls"].items() if count > 0}
        assert ran == {"__init__", "train", *BALANCE_METHODS, "set_stage_and_offload"}, rank["calls"]
        assert rank["class_replaced"] == [] and rank["module_replaced"] == [], "ds_odc replaced transformers' code"
        assert rank["bound_on_instance"] == []
        # a config asked for the odc stage: the one documented hook, a pass-through to what was there
        assert rank["class_replaced_after_odc_config"] == ["__init__"] and rank["hook_wraps_the_installed_init"]
        assert rank["init_calls_after_odc_config"] == 2 and rank["bound_on_plain_instance_after_odc_config"] == []
    assert "post-import hook" not in output


def test_a_release_without_a_balance_method_imports_trains_and_refuses_only_the_balance_block(tmp_path):
    results, output = _run("renamed", tmp_path)
    assert "post-import hook" not in output, "the release must import without ds_odc's hooks failing"
    import transformers

    for rank in results:
        assert rank["release_lacks_method"] and rank["ds_odc_imported"]
        assert rank["engine"] == "DeepSpeedEngine" and len(rank["losses"]) == 2
        assert rank["class_replaced"] == [] and rank["module_replaced"] == [] and rank["bound_on_instance"] == []
        assert rank["odc"] == {"built": True, "bound": ["log", "train"]}
        assert not rank["odc_balance"]["built"]
        error = rank["odc_balance"]["error"]
        assert "zero_optimization.odc.balance" in error and "Trainer._track_num_input_tokens" in error
        assert f"transformers {transformers.__version__}" in error
        assert rank["class_replaced_after_odc_config"] == ["__init__"]
