"""Rank workloads for the monitor tests: engines whose ds_config enables DeepSpeed's TensorBoard and CSV monitors,
run with uneven micro-batch counts on ODC (equal ones on ZeRO-3, measured by ``ds_odc.metrics.attach``), a Trainer
that reports to TensorBoard; every rank returns what its recorder saw, and the parent reads back what the monitors
and the timeline wrote."""
from __future__ import annotations

import os

import deepspeed
import torch
import torch.distributed as tdist

import ds_odc.metrics
from ds_odc.metrics import PlannedStep
from tests.support.workloads import ds_config, make_model, micro_batch, mse_mean

#: the plan every ODC step notes (rank costs 1 and 3: a predicted balance of 2/3)
PLAN = PlannedStep((1.0, 3.0), 3.0)


def monitor_config(stage, out_dir: str, interval: int = 0, timeline: dict | None = None,
                   odc_extra: dict | None = None) -> dict:
    odc = {"metrics_log_interval": interval, **(odc_extra or {})}
    if timeline is not None:
        odc["timeline"] = timeline
    config = ds_config(stage, managed=False, **({"odc": odc} if stage == "odc" else {}))
    config["tensorboard"] = {"enabled": True, "output_path": os.path.join(out_dir, "tb"), "job_name": "job"}
    config["csv_monitor"] = {"enabled": True, "output_path": os.path.join(out_dir, "csv"), "job_name": "job"}
    return config


def monitored_run(stage, out_dir: str, counts=(1, 3), steps: int = 3, interval: int = 0,
                  timeline: dict | None = None, plan: bool = True, odc_extra: dict | None = None) -> dict:
    """``steps`` optimizer steps, rank r running ``counts[r]`` micro-batches of 4 rows each (``odc_extra``: more
    odc options). Returns this rank's step reports (with their events) and the global step after each."""
    rank = tdist.get_rank()
    engine, *_ = deepspeed.initialize(model=make_model(),
                                      config=monitor_config(stage, out_dir, interval, timeline, odc_extra))
    if stage != "odc":
        ds_odc.metrics.attach(engine, interval)
    global_steps = []
    for step in range(steps):
        if plan:
            ds_odc.metrics.note_plan(engine, PLAN)
        for index in range(counts[rank]):
            x, y, _ = micro_batch(step, rank, index)
            engine.backward(mse_mean(engine(x), y))
        engine.step()
        global_steps.append(engine.global_steps)
    reports = list(engine.odc_metrics.reports)
    engine.destroy()
    return {"reports": reports, "global_steps": global_steps, "engine": type(engine).__name__}


def trainer_run(stage, output_dir: str, balance: dict | None = None, steps: int = 3, logging_steps: int = 1) -> dict:
    """The balanced-Trainer workload of ``hf_balance_workloads`` reporting to TensorBoard: its log history."""
    from transformers import LlamaForCausalLM, Trainer, TrainingArguments

    from tests.support.hf_balance_workloads import LongTailedDataset, balance_ds_config, llama_config, pad_collator

    args = TrainingArguments(
        output_dir=output_dir, deepspeed=balance_ds_config(stage, balance), use_cpu=True, max_steps=steps,
        per_device_train_batch_size=4, gradient_accumulation_steps=2, learning_rate=3e-3, logging_steps=logging_steps,
        save_strategy="no", report_to="tensorboard", seed=0, data_seed=0, disable_tqdm=True,
        remove_unused_columns=False)  # TensorBoard's events under output_dir/runs/
    torch.manual_seed(0)
    trainer = Trainer(model=LlamaForCausalLM(llama_config()), args=args, train_dataset=LongTailedDataset(64, seed=3),
                      data_collator=pad_collator)
    trainer.train()
    recorder = getattr(trainer.model_wrapped, "odc_metrics", None)
    return {"log_history": trainer.state.log_history, "engine": type(trainer.model_wrapped).__name__,
            "reports": None if recorder is None else list(recorder.reports)}


def monitored_split_run(out_dir: str, steps: int = 3) -> dict:
    """The split-policy training of ``split_workloads`` (4 ranks, hand-written plans, uneven counts) with the CSV
    monitor on and each step's plan noted: every rank's split entries per step and its step reports."""
    from ds_odc.balance import split_batch
    from tests.support import split_workloads as split
    from tests.support.sp_workloads import tiny_llama

    rank = tdist.get_rank()
    config = split.ds_config()
    config["csv_monitor"] = {"enabled": True, "output_path": os.path.join(out_dir, "csv"), "job_name": "job"}
    model = tiny_llama()
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    split_entries = []
    for step in range(steps):
        step_plan = split.plan(step)
        ds_odc.metrics.note_plan(engine, step_plan)
        mine = step_plan.for_rank(rank)
        split_entries.append(sum(1 for entry in mine if len(entry.ranks) > 1))
        for entry in mine:
            part = split_batch(split.packed(step, entry.samples, step_plan.lengths), entry, rank)
            with engine.odc_micro_batch(entry):
                logits = engine(input_ids=part["input_ids"], position_ids=part["position_ids"], use_cache=False).logits
                loss, tokens = split.token_sum(logits, part["shift_labels"])
                engine.backward(loss, loss_tokens=tokens)
        engine.step()
    reports = list(engine.odc_metrics.reports)
    engine.destroy()
    return {"split_entries": split_entries, "reports": reports,
            "plans": [ds_odc.metrics.planned_step(split.plan(step)) for step in range(steps)]}
