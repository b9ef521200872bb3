"""The Hugging Face examples run end to end on 2 CPU ranks, as their docstrings say to run them: the Trainer with the
balance block (examples/hf_trainer_sft.py), a LoRA adapter (lora_sft.py), a mixture-of-experts model (moe_sft.py)
and TRL's SFTTrainer through the marker form (trl_sft.py)."""
import os
import re
import subprocess
import sys

import pytest

pytest.importorskip("transformers")

from tests.support.harness import free_port  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLES = os.path.join(ROOT, "examples")
STEPS = 4


def _run_example(script: str, *args: str) -> str:
    env = {key: value for key, value in os.environ.items() if key != "DS_ODC_AUTOLOAD"}
    env.update(DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
           os.path.join(EXAMPLES, script), "--steps", str(STEPS), *args]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240, cwd=ROOT)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-4000:]
    assert "engine: ODCEngine, zero stage 3, 2 ranks on cpu" in output, output[-3000:]
    return output


def _logged_steps(output: str) -> list:
    """(loss, grad norm, the rest of the line) of each step PrintLoss printed."""
    steps = re.findall(rf"step \d+/{STEPS} \| loss ([\d.]+) \| grad norm ([\d.]+)(.*)", output)
    assert len(steps) == STEPS, output[-3000:]
    for loss, norm, _ in steps:
        assert 0 < float(loss) < 10 and 0 < float(norm) < 1e3, output[-3000:]
    return steps


def test_hf_trainer_example_with_the_balance_block_runs_uneven_counts_and_saves(tmp_path):
    output = _run_example("hf_trainer_sft.py", "--output_dir", str(tmp_path),
                          "--ds_config", os.path.join(EXAMPLES, "ds_config_hf_balance_odc.json"))
    counts = [re.search(r"micro-batches (\d+)/(\d+)", rest) for _, _, rest in _logged_steps(output)]
    assert all(counts), output[-3000:]  # the balance block planned every step
    assert any(match.group(1) != match.group(2) for match in counts), [m.group(0) for m in counts]
    assert os.path.getsize(tmp_path / "model.safetensors") > 100_000, "save_model wrote no full weights"


def test_lora_example_pushes_only_the_adapters_and_saves_them_trained(tmp_path):
    from safetensors.torch import load_file

    output = _run_example("lora_sft.py", "--output_dir", str(tmp_path))
    trainable, frozen = map(int, re.search(r"lora: (\d+) trainable parameters, (\d+) frozen", output).groups())
    assert frozen > 4 * trainable > 0, output[-2000:]
    for _, _, rest in _logged_steps(output):
        pushed = int(re.search(r"pushed (\d+) B", rest).group(1))
        # fp32 gradients of the adapters, 2 micro-batches a step: any of the frozen base's would exceed it
        assert 0 < pushed <= 2 * 4 * trainable, (pushed, trainable)
    adapters = load_file(str(tmp_path / "adapter_model.safetensors"))
    assert sum(t.numel() for t in adapters.values()) == trainable, sorted(adapters)
    trained = [name for name, tensor in adapters.items() if "lora_B" in name]
    assert trained and all(adapters[name].abs().sum() > 0 for name in trained), "lora_B left at its zero init"


def test_moe_example_trains_fused_experts_with_the_router_loss(tmp_path):
    output = _run_example("moe_sft.py", "--output_dir", str(tmp_path))
    losses = [float(loss) for loss, _, _ in _logged_steps(output)]
    assert losses[-1] < losses[0], losses
    assert "moe: 4 expert tensors, router aux loss on" in output, output[-2000:]


def test_trl_sft_example_runs_on_odc_through_the_marker_form(tmp_path):
    output = _run_example("trl_sft.py", "--output_dir", str(tmp_path))
    losses = [float(value) for value in re.search(r"\| losses ([\d. ]+)", output).group(1).split()]
    assert len(losses) == STEPS and losses[-1] < losses[0], losses
