"""LLaMA-Factory SFT and DPO through its own CLI (``llamafactory-cli train cfg.yaml``), on 2 CPU ranks.

    python llamafactory_driver.py {sft,dpo} MODEL_DIR OUTPUT_DIR

This process only writes the files a user writes (an alpaca-format data set and its ``dataset_info.json``,
the training YAML, the ds_config its ``deepspeed:`` key names) and runs the CLI, which starts torchrun
itself (``FORCE_TORCHRUN=1 NPROC_PER_NODE=2``). LLaMA-Factory compares the stage with 3 itself
(``is_deepspeed_zero3_enabled``), so ODC is asked for by the marker form (route "marker": stage 3 plus an
``"odc"`` block); the baseline is the same file without the block. Losses come from the
``trainer_log.jsonl`` LLaMA-Factory writes (``logging_steps: 1``).
"""
import json
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402

STEPS = int(os.environ.get("DS_ODC_COMPAT_STEPS", "4"))


def write_data(directory: str) -> None:
    sft = [{"instruction": f"repeat {common.sentence(i, 1 + i % 3)}", "input": "", "output": text}
           for i, text in enumerate(common.sft_texts())]
    dpo = [{"instruction": row["prompt"], "input": "", "chosen": row["chosen"], "rejected": row["rejected"]}
           for row in common.preference_rows()]
    columns = {"prompt": "instruction", "query": "input", "chosen": "chosen", "rejected": "rejected"}
    info = {"compat_sft": {"file_name": "sft.json"},
            "compat_dpo": {"file_name": "dpo.json", "ranking": True, "columns": columns}}
    for name, content in (("sft.json", sft), ("dpo.json", dpo), ("dataset_info.json", info)):
        with open(os.path.join(directory, name), "w") as handle:
            json.dump(content, handle)


def training_yaml(scenario: str, model_dir: str, output_dir: str, ds_path: str) -> str:
    """The YAML a user writes: full fine-tuning, fp32 on CPU, one log line per step."""
    lines = {
        "model_name_or_path": model_dir, "stage": scenario, "do_train": "true", "finetuning_type": "full",
        "deepspeed": ds_path, "dataset": f"compat_{scenario}", "dataset_dir": output_dir, "template": "default",
        "cutoff_len": 64, "overwrite_cache": "true", "preprocessing_num_workers": 1, "output_dir": output_dir,
        "logging_steps": 1, "save_strategy": '"no"', "plot_loss": "false", "overwrite_output_dir": "true",
        "per_device_train_batch_size": 2, "gradient_accumulation_steps": 2, "learning_rate": "1.0e-3",
        "max_steps": STEPS, "lr_scheduler_type": "constant", "bf16": "false", "use_cpu": "true",
        "report_to": "none", "seed": 0, "dataloader_num_workers": 0,
    }
    if scenario == "dpo":
        lines.update({"pref_beta": 0.1, "pref_loss": "sigmoid"})
    return "".join(f"{key}: {value}\n" for key, value in lines.items())


def main():
    scenario, model_dir, output_dir = sys.argv[1:4]
    os.makedirs(output_dir, exist_ok=True)
    write_data(output_dir)
    ds_path = os.path.join(output_dir, "ds_config.json")
    with open(ds_path, "w") as handle:
        json.dump(common.ds_config(common.route(), common.HF_BASE), handle)
    cfg_path = os.path.join(output_dir, "train.yaml")
    with open(cfg_path, "w") as handle:
        handle.write(training_yaml(scenario, model_dir, output_dir, ds_path))
    bin_dir = os.path.dirname(sys.executable)  # the CLI starts "torchrun" from PATH: this venv's
    env = {**os.environ, "PATH": bin_dir + os.pathsep + os.environ.get("PATH", ""), "FORCE_TORCHRUN": "1",
           "NPROC_PER_NODE": "2", "DISABLE_VERSION_CHECK": "1",
           "MASTER_PORT": os.environ.get("MASTER_PORT", "29511")}
    cli = os.path.join(bin_dir, "llamafactory-cli")
    done = subprocess.run([cli, "train", cfg_path], env=env)
    if done.returncode:
        raise SystemExit(f"llamafactory-cli exited {done.returncode}")
    with open(os.path.join(output_dir, "trainer_log.jsonl")) as handle:
        rows = [json.loads(line) for line in handle if line.strip()]
    common.write_result([row["loss"] for row in rows if "loss" in row])


if __name__ == "__main__":
    main()
