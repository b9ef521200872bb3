"""The examples on a GPU as written: each runs a few steps as one rank under torchrun, with no accelerator named in
the environment (DeepSpeed picks CUDA, as it would for a user), and says it trained with the odc engine on cuda.
The validation kit's second command runs this file (item ``examples``); without CUDA it is skipped. On CPU ranks the
same scripts run in tests/distributed/test_hf_example.py and test_examples.py; the two-node example needs two
nodes and is left to tests/distributed/test_two_hosts.py."""
import os
import re
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="the examples on a GPU need CUDA")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLES = os.path.join(ROOT, "examples")
STEPS = 3
#: script, its arguments past --steps, and what its rank 0 prints about the engine and its device
RUNS = {
    "train_causal_lm": ("train_causal_lm.py", [], r"engine: ODCEngine, zero stage 3, 1 ranks, .* on cuda"),
    "hf_trainer_balance": ("hf_trainer_sft.py",
                           ["--ds_config", os.path.join(EXAMPLES, "ds_config_hf_balance_odc.json")],
                           r"step \d+/3 \| loss"),
    "trl_sft": ("trl_sft.py", [], r"\| losses [\d. ]+"),
    "lora_sft": ("lora_sft.py", [], r"lora: \d+ trainable parameters"),
    "moe_sft": ("moe_sft.py", [], r"moe: \d+ expert tensors"),
}
HF_ENGINE_LINE = r"engine: ODCEngine, zero stage 3, 1 ranks on cuda"


@pytest.mark.parametrize("name", sorted(RUNS))
def test_the_example_trains_on_the_gpu_without_edits(name, tmp_path):
    script, args, expected = RUNS[name]
    env = {key: value for key, value in os.environ.items() if key not in ("DS_ACCELERATOR", "DS_ODC_AUTOLOAD")}
    argv = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "1", "--master_port", "29613",
            os.path.join(EXAMPLES, script), "--steps", str(STEPS), *args]
    if script != "train_causal_lm.py":
        argv += ["--output_dir", str(tmp_path)]
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300, cwd=ROOT)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-4000:]
    assert re.search(expected, output), output[-3000:]
    if script != "train_causal_lm.py":
        assert re.search(HF_ENGINE_LINE, output), output[-3000:]  # every HF example prints it at the end
