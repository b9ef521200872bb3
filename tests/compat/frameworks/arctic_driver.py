"""ArcticTraining SFT through its own CLI (``arctic_training train.yaml --num_gpus 2``), on 2 CPU ranks.

    python arctic_driver.py {sft,sft_marker} MODEL_DIR OUTPUT_DIR

This process only writes what a user writes (a local data set of user/assistant turns, saved with
``save_to_disk`` so ArcticTraining's Hugging Face source loads it from the path, and the training YAML)
and runs the CLI, which starts its ranks through the DeepSpeed launcher. ArcticTraining passes the YAML's
``deepspeed:`` dict through (it adds batch sizes, clipping and the like, and keeps ``zero_optimization``
as written), so ODC is asked for by ``"stage": "odc"`` there (route "odc", scenario ``sft``) or by the marker
form, ``stage: 3`` plus an ``odc:`` block (route "marker", scenario ``sft_marker``); the baseline is the same
YAML with ``stage: 3`` alone. Its ``HfDeepSpeedConfig(config.deepspeed)`` canonicalises the dict in place before
``from_pretrained``, so the model is built under ``zero.Init`` on both routes.

The optimizer is ArcticTraining's ``cpu_adam`` (DeepSpeed's ``DeepSpeedCPUAdam``, JIT-built with ninja on
first use and cached under ``~/.cache/torch_extensions``): its SFT trainer accepts only ``fused_adam`` and
``cpu_adam``, and FusedAdam has no CPU build. fp32 (``model.dtype: float32``), no activation checkpointing,
a constant learning rate. Losses come from ``train_log_metrics_path`` (one line per optimizer step, the
loss averaged over the ranks and the accumulated micro-batches by ArcticTraining). At the end its Hugging
Face checkpoint engine saves the model (its ``zero_3_enabled`` branch: each parameter gathered); the
result carries per-tensor sums of the saved weights, which the runner compares between the routes.
"""
import json
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402

STEPS = int(os.environ.get("DS_ODC_COMPAT_STEPS", "4"))


def write_data(directory: str) -> str:
    """64 single-turn conversations with long-tailed answers, as a data set on disk (no hub)."""
    from datasets import Dataset

    rows = [{"user": f"repeat {common.sentence(i, 1 + i % 3)}", "assistant": text}
            for i, text in enumerate(common.sft_texts())]
    path = os.path.join(directory, "sft_data")
    Dataset.from_list(rows).save_to_disk(path)
    return path


def deepspeed_section(route: str) -> dict:
    """The YAML's ``deepspeed:`` dict: fp32, stage 3 with ``"stage": "odc"`` on the odc route."""
    base = {"zero_optimization": {"stage": 3}, "bf16": {"enabled": False}}
    return common.ds_config(route, base)


def training_yaml(model_dir: str, output_dir: str, data_path: str, route: str) -> dict:
    return {
        "type": "sft",
        "seed": 0,
        "micro_batch_size": 2,
        "gradient_accumulation_steps": 2,
        "exit_iteration": STEPS,
        "train_log_iter_interval": 1,
        "train_log_metrics_path": os.path.join(output_dir, "train-log-metrics.jsonl"),
        "kill_switch_path": os.path.join(output_dir, "kill_switch"),
        "model": {"name_or_path": model_dir, "dtype": "float32", "attn_implementation": "sdpa",
                  "disable_activation_checkpoint": True},
        "data": {"sources": [{"name_or_path": data_path}], "max_length": 256, "div_length": 16, "num_proc": 1,
                 "dl_num_workers": 1, "cache_dir": os.path.join(output_dir, "data_cache"), "seed": 0},
        "optimizer": {"type": "cpu_adam", "lr": 1.0e-3, "weight_decay": 0.0},
        "scheduler": {"name": "constant", "warmup_ratio": 0.0},
        "checkpoint": [{"type": "huggingface", "output_dir": os.path.join(output_dir, "hf_checkpoint"),
                        "save_end_of_training": True}],
        "logger": {"output_dir": os.path.join(output_dir, "logs"), "level": "INFO"},
        "deepspeed": deepspeed_section(route),
    }


def saved_weights(checkpoint_root: str, model_dir: str) -> dict:
    """{name: [sum, sum of |x|]} of the weights ArcticTraining's Hugging Face checkpoint engine saved at the
    end of training; its ZeRO-3 path (``config.zero_3_enabled``, read after ``deepspeed.initialize``) gathers
    each parameter. Refuses a checkpoint whose tensors do not have the model's full shapes (a rank's
    partition saved instead of the gathered parameter)."""
    import glob

    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    files = sorted(glob.glob(os.path.join(checkpoint_root, "**", "*.safetensors"), recursive=True))
    if not files:
        raise SystemExit(f"no safetensors under {checkpoint_root}")
    saved = {}
    for name in files:
        saved.update(load_file(name))
    reference = {name: tuple(p.shape) for name, p in AutoModelForCausalLM.from_pretrained(model_dir).named_parameters()}
    shapes = {name: tuple(t.shape) for name, t in saved.items()}
    if shapes != reference:
        raise SystemExit(f"saved checkpoint shapes {shapes} differ from the model's {reference}")
    return {name: [float(t.double().sum()), float(t.double().abs().sum())] for name, t in sorted(saved.items())
            if torch.is_floating_point(t)}


def main():
    scenario, model_dir, output_dir = sys.argv[1:4]
    if scenario not in ("sft", "sft_marker"):  # the same run; the runner's route picks "odc" or the marker form
        raise SystemExit(f"unknown ArcticTraining scenario {scenario!r} (sft, sft_marker)")
    os.makedirs(output_dir, exist_ok=True)
    data_path = write_data(output_dir)
    cfg_path = os.path.join(output_dir, "train.yaml")
    with open(cfg_path, "w") as handle:  # JSON is YAML; ArcticTraining reads it with yaml.load
        json.dump(training_yaml(model_dir, output_dir, data_path, common.route()), handle, indent=1)
    metrics = os.path.join(output_dir, "train-log-metrics.jsonl")
    if os.path.exists(metrics):
        os.remove(metrics)
    bin_dir = os.path.dirname(sys.executable)  # the DeepSpeed launcher finds arctic_training_run on PATH
    env = {**os.environ, "PATH": bin_dir + os.pathsep + os.environ.get("PATH", "")}
    port = os.environ.get("MASTER_PORT", "29512")
    cli = [os.path.join(bin_dir, "arctic_training"), "train", cfg_path, "--num_gpus", "2", "--master_port", port]
    done = subprocess.run(cli, env=env, cwd=output_dir)
    if done.returncode:
        raise SystemExit(f"arctic_training exited {done.returncode}")
    with open(metrics) as handle:
        rows = [json.loads(line) for line in handle if line.strip()]
    common.write_result([row["loss"] for row in rows if "loss" in row],
                        weights=saved_weights(os.path.join(output_dir, "hf_checkpoint"), model_dir))


if __name__ == "__main__":
    main()
