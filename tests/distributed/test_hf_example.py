"""examples/hf_trainer_sft.py (HF Trainer SFT on a tiny Llama) runs end to end on 2 CPU ranks."""
import os
import re
import subprocess
import sys

import pytest

pytest.importorskip("transformers")

from tests.support.harness import free_port  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_hf_trainer_sft_example_trains_on_odc_under_torchrun(tmp_path):
    env = {key: value for key, value in os.environ.items() if key != "DS_ODC_AUTOLOAD"}
    env.update(DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
           os.path.join(ROOT, "examples", "hf_trainer_sft.py"), "--steps", "4", "--output_dir", str(tmp_path)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240, cwd=ROOT)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-4000:]
    assert "engine: ODCEngine, zero stage 3, 2 ranks" in output, output[-3000:]
    logged = [tuple(map(float, match))
              for match in re.findall(r"step \d+/4 \| loss ([\d.]+) \| grad norm ([\d.]+)", output)]
    assert len(logged) == 4 and all(0 < loss < 10 and 0 < norm < 1e3 for loss, norm in logged), output[-3000:]
    assert os.path.getsize(tmp_path / "model.safetensors") > 100_000, "save_model wrote no full weights"
