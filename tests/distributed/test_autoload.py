"""Zero code change: the installed ``ds_odc_autoload.pth`` activates ds_odc for scripts that never import it."""
import json
import os
import site
import subprocess
import sys

from tests.support.harness import free_port
from tests.support.workloads import ds_config

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "tests", "support", "unmodified_zero3_script.py")


def _env(**extra):
    env = {key: value for key, value in os.environ.items() if key != "DS_ODC_AUTOLOAD"}
    return {**env, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", **extra}


def _python(code, **env):
    return subprocess.run([sys.executable, "-c", code], env=_env(**env), capture_output=True, text=True,
                          timeout=120, cwd="/")


def _torchrun(nproc, config_path, **env):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_port",
           str(free_port()), SCRIPT, config_path]
    return subprocess.run(cmd, env=_env(**env), capture_output=True, text=True, timeout=180, cwd="/")


def test_the_pth_file_is_installed_and_interpreter_start_stays_cheap():
    assert any(os.path.isfile(os.path.join(d, "ds_odc_autoload.pth")) for d in site.getsitepackages()), \
        "ds_odc_autoload.pth missing from site-packages: reinstall with pip install -e ."
    done = _python("import sys; loaded = [m for m in ('torch', 'deepspeed', 'ds_odc', 'accelerate', 'transformers') "
                   "if m in sys.modules]; assert not loaded, loaded; assert 'ds_odc_autoload' in sys.modules")
    assert done.returncode == 0, done.stderr[-3000:]


def test_importing_deepspeed_registers_the_odc_stage_unless_turned_off():
    probe = ("import sys, deepspeed; print('registered' if 'ds_odc' in sys.modules and "
             "deepspeed.initialize.__name__ == 'initialize' and hasattr(deepspeed.initialize, '__wrapped__') "
             "else 'plain')")
    assert _python(probe).stdout.split()[-1] == "registered"
    assert _python(probe, DS_ODC_AUTOLOAD="0").stdout.split()[-1] == "plain"


def test_training_arguments_see_odc_as_zero3_without_importing_ds_odc():
    """TrainingArguments reads the stage before anything imports deepspeed; a stage-3 config stays cheap."""
    code = ("import sys, json; from transformers import TrainingArguments; "
            "from transformers.integrations import is_deepspeed_zero3_enabled; "
            "a = TrainingArguments(output_dir='/tmp/unused', use_cpu=True, report_to='none', "
            "deepspeed={'zero_optimization': {'stage': sys.argv[1]}, 'train_micro_batch_size_per_gpu': 'auto'}); "
            "print(json.dumps([is_deepspeed_zero3_enabled(), a.deepspeed_plugin.zero_stage, 'ds_odc' in sys.modules]))")
    outputs = {}
    for stage in ("odc", "3"):
        done = subprocess.run([sys.executable, "-c", code.replace("sys.argv[1]", repr(stage) if stage == "odc"
                                                                   else "3")],
                              env=_env(), capture_output=True, text=True, timeout=120, cwd="/")
        assert done.returncode == 0, done.stderr[-3000:]
        outputs[stage] = json.loads(done.stdout.strip().splitlines()[-1])
    assert outputs["odc"] == [True, 3, True]
    assert outputs["3"] == [True, 3, False]


def test_an_unmodified_zero3_script_gets_an_odc_engine_from_the_config_alone(tmp_path):
    odc_path, zero3_path = tmp_path / "odc.json", tmp_path / "zero3.json"
    odc_path.write_text(json.dumps(ds_config("odc")))
    zero3_path.write_text(json.dumps(ds_config(3)))

    odc = _torchrun(2, str(odc_path))
    assert odc.returncode == 0, (odc.stdout + odc.stderr)[-4000:]
    for rank in range(2):
        assert f"rank {rank} engine ODCEngine ds_odc imported True" in odc.stdout, odc.stdout[-2000:]

    off = _torchrun(1, str(odc_path), DS_ODC_AUTOLOAD="0")
    assert off.returncode != 0 and "ODCEngine" not in off.stdout
    assert "Input should be 0, 1, 2, 3" in off.stdout + off.stderr, (off.stdout + off.stderr)[-3000:]
