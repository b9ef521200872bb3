"""What the ranks run for the combination jobs (test_combinations.py, run_combinations.py): each job of a list, one
after the other in the same ranks, on the odc stage, and on ZeRO-3 where it can run the same job; every job builds
and destroys its own engines.

Each rank writes one record per job to ``out_dir`` (``job<index>_rank<rank>.pt``) as soon as the job is done, so a
parent that finds the ranks hung or dead still has every finished job and knows which one was running. A record:
``{"odc": run, "zero3": run or None, "leftovers": [...], "new_resources": {...}, "seconds": s}``, a run being
``{"outcome": "ok", "params": [fp32 parameters after each step], "tokens": {step: generated}}`` or
``{"outcome": "error", "phase", "type", "message", "traceback"}``.

Between jobs: every rank at a barrier; then what the job left (``ds_odc_*`` files in the private ``shm_dir`` every
job's engines use, threads, open descriptors and mappings of segments other than the rank's own windows, which
DeepSpeed keeps alive with every engine it built: see config_fuzz_oracle.problems_of) is recorded.

Sequence parallelism: ALST's ``register_with_transformers`` builds its groups once per process and replaces the sdpa
attention process-wide, and has no way back. The groups are built once, before the first job, when any job needs
them; the attention entry is ALST's during an SP job and transformers' own otherwise (:func:`_sp_attention`).
"""
from __future__ import annotations

import contextlib
import gc
import os
import re
import threading
import time
import traceback
from typing import Optional

import deepspeed
import torch
import torch.distributed as tdist

from tests.support.combination_jobs import MIN_CHUNK_TOKENS, OFFLOAD_INCLUDE, SPLIT_CAP, Job
from tests.support.combination_reference import (
    ADAM_EPS,
    CLIP,
    LR,
    MODEL_SEED,
    REFERENCE_SEED,
    RESUMED_SEED,
    loss_sum,
    new_tokens,
    packed,
    prompt,
    tiny_llama,
)
from tests.support.frozen_heap import freeze_imports

#: a rank that makes no progress is named by its peers after this long (a bug found by a job fails the job, not
#: the whole list); the process group's bound (harness pg_timeout_s) is longer
TIMEOUT_S = 30.0

_SP: dict = {"mpu": None, "ulysses": None, "sdpa": None}


# -- configs ------------------------------------------------------------------------------------------------------
def _optimizer(job: Job) -> dict:
    if job.optimizer == "sgd":
        return {"type": "SGD", "params": {"lr": LR["sgd"], "momentum": 0.9}}
    if job.optimizer == "adamw":
        return {"type": "AdamW", "params": {"lr": LR["adamw"], "torch_adam": True, "weight_decay": 0.01,
                                            "eps": ADAM_EPS}}
    return {"type": "Adam", "params": {"lr": LR["fused-adam"], "weight_decay": 0.0, "eps": ADAM_EPS}}  # FusedAdam


def _zero(job: Job, stage, shm_dir: str, frozen: bool) -> dict:
    zero: dict = {"stage": stage, "stage3_param_persistence_threshold": 0, "stage3_max_live_parameters": 0,
                  "stage3_prefetch_bucket_size": 0}  # parameters released after every use, as a model of real size
    if not frozen and job.offload in ("optimizer", "both"):
        zero["offload_optimizer"] = {"device": "cpu"}
    if job.offload in ("param", "both"):
        zero["offload_param"] = {"device": "cpu"}
    if stage == "odc":
        odc: dict = {"timeout_s": TIMEOUT_S, "shm_dir": shm_dir}
        if not frozen and job.activation_offload != "none":
            odc["activation_offload"] = {"budget_mb": 0, "mode": job.activation_offload}
        if not frozen and job.accumulator != "fp32":
            odc["accumulator_dtype"] = job.accumulator
        if not frozen and job.split:
            odc["balance"] = {"policy": "lb-mini-split", "token_cap": SPLIT_CAP, "max_group": 2,
                              "min_chunk_tokens": MIN_CHUNK_TOKENS}
        zero["odc"] = odc
    return zero


def policy_config(job: Job, stage, shm_dir: str) -> dict:
    config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": job.gas,
              "optimizer": _optimizer(job), "gradient_clipping": CLIP[job.clip], "steps_per_print": 10 ** 9,
              "wall_clock_breakdown": False, "zero_allow_untested_optimizer": True,
              "zero_optimization": _zero(job, stage, shm_dir, frozen=False)}
    if not job.managed:
        config["managed_gradient_accumulation"] = False
    if job.dtype == "bf16":
        config["bf16"] = {"enabled": True}
    return config


def frozen_config(job: Job, stage, shm_dir: str) -> dict:
    """A reference model's config as TRL's prepare_deepspeed builds it: the ZeRO section, no optimizer."""
    config = {"train_micro_batch_size_per_gpu": 1, "steps_per_print": 10 ** 9,
              "zero_optimization": _zero(job, stage, shm_dir, frozen=True)}
    if job.dtype == "bf16":
        config["bf16"] = {"enabled": True}
    return config


# -- engines ------------------------------------------------------------------------------------------------------
def _sp_attention(on: bool) -> None:
    """ALST's attention while an SP job runs, transformers' sdpa otherwise (see the module docstring)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if _SP["sdpa"] is None:
        _SP["sdpa"] = ALL_ATTENTION_FUNCTIONS["sdpa"]
    if on and _SP["mpu"] is None:
        from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF

        _SP["mpu"] = UlyssesSPAttentionHF.register_with_transformers(
            model_name_or_path=tiny_llama(), core_attn_implementation="sdpa", sequence_parallel_size=2,
            micro_batch_size=1)
        _SP["ulysses"] = ALL_ATTENTION_FUNCTIONS["sdpa"]
    ALL_ATTENTION_FUNCTIONS["sdpa"] = _SP["ulysses"] if on else _SP["sdpa"]
    # DeepSpeed keeps the mpu of the last initialize(mpu=...) process-wide (deepspeed.utils.groups.mpu) and reads
    # the SP size of every later engine from it: an engine of a job without SP must not find it there
    from deepspeed.utils import groups

    groups.mpu = _SP["mpu"] if on else None


def _model(job: Job, seed: int):
    model = tiny_llama(seed)
    if job.checkpointing != "none":
        model.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs={"use_reentrant": job.checkpointing == "reentrant"})
    return model


def _policy(job: Job, stage, shm_dir: str, seed: int):
    model = _model(job, seed)
    mpu = _SP["mpu"] if job.sp_size > 1 else None
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                      config=policy_config(job, stage, shm_dir), mpu=mpu)
    return engine


class _Run:
    """One job on one stage in this rank: its engines, the phase it is in, what it recorded."""

    def __init__(self, job: Job, stage, shm_dir: str, ckpt_dir: str):
        self.job, self.stage, self.shm_dir, self.ckpt_dir = job, stage, shm_dir, ckpt_dir
        self.rank = tdist.get_rank()
        self.engine = None
        self.frozen = None
        self.told = None  # transformers' HfDeepSpeedConfig, alive while the job runs (its synced_gpus default)
        self.phase = "initialize"
        self.params: list = []
        self.tokens: dict = {}

    # -- the steps --
    def run(self) -> None:
        from transformers.integrations import HfDeepSpeedConfig

        job = self.job
        config = policy_config(job, self.stage, self.shm_dir)
        self.told = HfDeepSpeedConfig(config)
        if job.reference_model != "none":  # built before the policy, as TRL builds a DPO reference model
            model = tiny_llama(REFERENCE_SEED).eval()
            self.frozen, *_ = deepspeed.initialize(model=model, config=frozen_config(job, self.stage, self.shm_dir))
        self.engine = _policy(job, self.stage, self.shm_dir, MODEL_SEED)
        self.phase = "train"
        for step in range(len(job.layout)):
            if step == job.generate_at:
                self.tokens[step] = self._generate()
            if step == job.offload_at and job.offload_states == "between":
                self._offload_states()
            if step == job.checkpoint_at:
                self._save_and_resume(step)
            self._step(step)
            self.params.append(_full_fp32(self.engine))

    def _step(self, step: int) -> None:
        job, engine, rank = self.job, self.engine, self.rank
        layout = job.layout[step]
        entries = layout.entries_for(rank)
        micro_batches = self._micro_batches(step)
        outside = self._outside_reference(step, entries, micro_batches) if job.reference_model == "outside" else None
        if job.offload_at == step and job.offload_states == "mid" and not entries:
            self._offload_states()
        managed_steps = job.managed and not job.coalesce
        if job.coalesce:
            engine.set_gradient_accumulation_boundary(True)  # kept by the block: the step after it is the boundary
        with engine.coalesce_grad_reduction() if job.coalesce else contextlib.nullcontext():
            for m, (entry, micro_batch) in enumerate(zip(entries, micro_batches)):
                if managed_steps and not job.deepspeed_boundary:
                    engine.set_gradient_accumulation_boundary(m == len(entries) - 1)
                self._micro_batch(step, entry, micro_batch, outside[m] if outside is not None else None)
                # collective on the odc stage: every rank moves its windows inside the same step, so before the
                # engine.step() that may be this rank's boundary (a rank with one micro-batch) and not after it
                if job.offload_at == step and job.offload_states == "mid" and m == 0:
                    self._offload_states()
                if managed_steps:
                    engine.step()
        if managed_steps and not entries:
            engine.set_gradient_accumulation_boundary(True)
            engine.step()
        elif not managed_steps:
            engine.step()

    def _micro_batches(self, step: int) -> list:
        """The ds_odc MicroBatch of each of this rank's entries (a split plan's, validated, under the split policy)."""
        from ds_odc.balance import AllToAllCost, CostModel, MicroBatch, SplitCostModel, SplitMicroBatch, SplitPlan

        layout = self.job.layout[step]
        entries = layout.entries_for(self.rank)
        if not self.job.split:
            return [MicroBatch(entry.samples, entry.ranks) for entry in entries]
        splits = tuple(SplitMicroBatch(entry.samples, len(entry.ranks), entry.ranks[0] // len(entry.ranks))
                       for entry in layout.entries if entry.split)
        whole = tuple(tuple(e.samples for e in layout.entries if not e.split and e.ranks == (r,))
                      for r in range(self.job.world))
        plan = SplitPlan(layout.lengths, SPLIT_CAP, SplitCostModel(CostModel.tokens(), AllToAllCost.free()),
                         self.job.world, splits, whole)
        plan.validate()
        mine = plan.for_rank(self.rank)
        assert [mb.samples for mb in mine] == [entry.samples for entry in entries], (mine, entries)
        return mine

    def _slice(self, batch: dict, entry, micro_batch) -> dict:
        from ds_odc.balance import split_batch
        from ds_odc.balance.slices import shard_for_sequence_parallel

        if self.job.sp_size > 1:
            return shard_for_sequence_parallel(batch, entry.ranks.index(self.rank), self.job.sp_size)
        return split_batch(batch, micro_batch, self.rank)

    def _outside_reference(self, step: int, entries, micro_batches) -> list:
        """The frozen model's logits of this rank's part of every entry, before any of them runs (DPO's precompute).
        Under fixed SP on the rank's slice (ALST's attention is process-wide: the group meets in it); else on the
        whole packed micro-batch, cut like its inputs afterwards."""
        logits = []
        with torch.no_grad():
            for entry, micro_batch in zip(entries, micro_batches):
                batch = packed(self.job, step, entry.samples)
                if self.job.sp_size > 1:
                    part = self._slice(batch, entry, micro_batch)
                    logits.append(self.frozen(input_ids=part["input_ids"], position_ids=part["position_ids"],
                                              use_cache=False).logits.float())
                else:
                    batch["reference_logits"] = self.frozen(input_ids=batch["input_ids"],
                                                            position_ids=batch["position_ids"],
                                                            use_cache=False).logits.float()
                    logits.append(self._slice(batch, entry, micro_batch)["reference_logits"])
        return logits

    def _micro_batch(self, step: int, entry, micro_batch, outside: Optional[torch.Tensor]) -> None:
        job, engine = self.job, self.engine
        part = self._slice(packed(job, step, entry.samples), entry, micro_batch)
        split = self.stage == "odc" and job.split
        scope = engine.odc_micro_batch(micro_batch, scaled_token_sum=job.loss == "scaled") if split \
            else contextlib.nullcontext()
        with scope:
            reference = outside
            if job.reference_model == "inside":
                with torch.no_grad():
                    reference = self.frozen(input_ids=part["input_ids"], position_ids=part["position_ids"],
                                            use_cache=False).logits
            logits = engine(input_ids=part["input_ids"], position_ids=part["position_ids"], use_cache=False).logits
            total, tokens = loss_sum(logits, part["shift_labels"], reference)
            if job.loss == "token":
                loss = total
            elif job.loss == "scaled":
                loss = total * job.world / max(job.layout[step].global_tokens, 1)
            elif job.sp_size > 1:  # the sequence's token mean, the same on every SP rank (HF's SP loss)
                from tests.support.sp_workloads import _GatherInGroup

                whole = sum(job.layout[step].tokens(i) for i in entry.samples)
                loss = _GatherInGroup.apply(total, _SP["mpu"].get_sequence_parallel_group()).sum() / whole
            else:
                loss = total / max(tokens, 1)
            if job.backward == "torch":
                if job.loss == "token":
                    engine.set_loss_tokens(tokens)
                loss.backward()
            elif job.loss == "token":
                engine.backward(loss, loss_tokens=tokens)
            else:
                engine.backward(loss, scale_wrt_gas=job.scale_wrt_gas)

    # -- the calls between steps --
    def _generate(self) -> list:
        """In eval mode, as a rollout runs (transformers drops the cache of a model in training mode with gradient
        checkpointing while generate() still feeds it one new token at a time: other tokens, on any stage)."""
        module = self.engine.module
        module.eval()
        try:
            with torch.no_grad():
                out = module.generate(prompt(self.job, self.rank), max_new_tokens=new_tokens(self.rank),
                                      min_new_tokens=new_tokens(self.rank), do_sample=False, eos_token_id=None,
                                      pad_token_id=0)
        finally:
            module.train()
        return out[0].tolist()

    def _offload_states(self) -> None:
        from deepspeed.runtime.zero.offload_config import OffloadStateTypeEnum

        names = OFFLOAD_INCLUDE[self.job.offload_include]
        include = None if names is None else [OffloadStateTypeEnum(name) for name in names]
        self.engine.offload_states(include=include)
        if self.frozen is not None and self.stage == "odc":  # ZeRO-3 refuses to offload an engine without optimizer
            self.frozen.offload_states()
            self.frozen.reload_states()
        self.engine.reload_states()

    def _save_and_resume(self, step: int) -> None:
        """Save, destroy the engine, build a fresh one on other initial weights, load, train on."""
        tag = f"step{step}"
        self.engine.save_checkpoint(self.ckpt_dir, tag=tag)
        self.engine.destroy()
        self.engine = None
        self.engine = _policy(self.job, self.stage, self.shm_dir, RESUMED_SEED)
        self.engine.load_checkpoint(self.ckpt_dir, tag=tag)

    def close(self) -> Optional[dict]:
        """Destroy what this run built; the error of a destroy that raised (described), if any."""
        error = None
        for engine in (self.engine, self.frozen):
            if engine is None:
                continue
            try:
                engine.destroy()
            except Exception as err:  # noqa: BLE001 - reported with the job
                error = error or _describe(err, "destroy")
        self.engine = self.frozen = self.told = None
        return error


def _full_fp32(engine) -> dict:
    from deepspeed.utils import safe_get_full_fp32_param

    return {name: safe_get_full_fp32_param(p).detach().clone().reshape(p.ds_shape).cpu()
            for name, p in engine.module.named_parameters() if p.requires_grad}


def _describe(err: BaseException, phase: str) -> dict:
    return {"outcome": "error", "phase": phase, "type": type(err).__name__, "message": str(err),
            "traceback": "".join(traceback.format_exception(type(err), err, err.__traceback__)[-8:])}


def attempt(job: Job, stage, shm_dir: str, ckpt_dir: str) -> dict:
    """Run ``job`` on ``stage`` in this rank: its outcome, and what it recorded."""
    _sp_attention(job.sp_size > 1)
    run = _Run(job, stage, shm_dir, ckpt_dir)
    try:
        run.run()
        result = {"outcome": "ok", "params": run.params, "tokens": run.tokens}
    except Exception as err:  # noqa: BLE001 - every outcome goes back to the parent
        result = _describe(err, run.phase)
    finally:
        destroy_error = run.close()
        _sp_attention(False)
    if destroy_error is not None and result["outcome"] == "ok":
        result = destroy_error
    return result


# -- what a job leaves behind -----------------------------------------------------------------------------------
_SEGMENT = re.compile(r"ds_odc_[0-9a-f]+_r\d+_\w+")


def resources() -> dict:
    """Python threads, open descriptors and mappings of ODC segments of this process, after a collection; and the
    process-wide state ds_odc keeps for live training engines (their SP and split locksteps, which a frozen engine's
    forward takes: none may outlive its engine) and the attention entry ALST and the split policy replace."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from ds_odc.integration import sequence_parallel

    gc.collect()
    with open("/proc/self/maps") as maps:
        mapped = {match.group(0) for line in maps for match in [_SEGMENT.search(line)] if match}
    sdpa = ALL_ATTENTION_FUNCTIONS["sdpa"]
    return {"threads": {t.name for t in threading.enumerate()}, "mapped": mapped,
            "locksteps": {repr(lockstep) for lockstep in sequence_parallel._training_locksteps},
            "attention": set() if sdpa is _SP["sdpa"] or _SP["sdpa"] is None else {repr(sdpa)},
            "native_threads": len(os.listdir("/proc/self/task")), "descriptors": len(os.listdir("/proc/self/fd"))}


def _forget_locksteps() -> None:
    """After a job that left a lockstep registered (a problem of that job, recorded): forget it, so that the frozen
    engines of the next jobs do not take a dead engine's lockstep and each job is judged on its own."""
    from ds_odc.integration import sequence_parallel

    sequence_parallel._training_locksteps.clear()


def new_resources(before: dict, after: dict) -> dict:
    """What ``after`` holds that ``before`` did not. A rank's own windows stay mapped by the engines DeepSpeed keeps
    alive after destroy() (config_fuzz_oracle.problems_of says why): not counted."""
    rank = tdist.get_rank()
    own = re.compile(rf"_r{rank}_(params|grads)$")
    return {"threads": sorted(after["threads"] - before["threads"]),
            "mapped": sorted(m for m in after["mapped"] - before["mapped"] if not own.search(m)),
            "locksteps": sorted(after["locksteps"] - before["locksteps"]),
            "attention": sorted(after["attention"] - before["attention"]),
            "native_threads": max(0, after["native_threads"] - before["native_threads"]),
            "descriptors": max(0, after["descriptors"] - before["descriptors"])}


def _leftovers(directory: str) -> list:
    return sorted(name for name in os.listdir(directory) if name.startswith("ds_odc_"))


def run_jobs(jobs, out_dir: str, shm_dir: str, ckpt_root: str, zero3: bool = True) -> list:
    """Every job of ``jobs`` in turn (see the module docstring); returns the indices done."""
    import shutil

    rank = tdist.get_rank()
    if any(job.sp_size > 1 for job in jobs):
        _sp_attention(True)  # ALST's groups, built once before the first job (see the module docstring)
        _sp_attention(False)
    import transformers.modeling_utils  # noqa: F401  imported before the freeze below, not inside the first job
    from transformers import LlamaForCausalLM  # noqa: F401

    freeze_imports()  # what exists now lives as long as the process; each job's collections walk what it makes
    tdist.barrier()
    done = []
    for index, job in enumerate(jobs):
        print(f"[rank {rank}] job {index} started: {job.describe()}", flush=True)
        before = resources()
        start = time.perf_counter()
        ckpt_dir = os.path.join(ckpt_root, f"job{index}")
        record: dict = {"seed": job.seed, "odc": attempt(job, "odc", shm_dir, os.path.join(ckpt_dir, "odc"))}
        tdist.barrier()
        if zero3 and job.zero3_comparable and record["odc"]["outcome"] == "ok":
            record["zero3"] = attempt(job, 3, shm_dir, os.path.join(ckpt_dir, "zero3"))
            tdist.barrier()
        record["leftovers"] = _leftovers(shm_dir)
        after = resources()
        record["new_resources"] = {k: v for k, v in new_resources(before, after).items()
                                   if k not in ("native_threads", "descriptors")}
        record["native_threads"], record["descriptors"] = after["native_threads"], after["descriptors"]
        if record["new_resources"]["locksteps"]:
            _forget_locksteps()
        record["seconds"] = time.perf_counter() - start
        path = os.path.join(out_dir, f"job{index}_rank{rank}.pt")
        torch.save(record, path + ".tmp")
        os.replace(path + ".tmp", path)
        print(f"[rank {rank}] job {index} done: {record['odc']['outcome']} {record['odc'].get('type', '')} "
              f"{record['seconds']:.1f}s", flush=True)
        tdist.barrier()
        if rank == 0:
            shutil.rmtree(ckpt_dir, ignore_errors=True)
        done.append(index)
    return done


# -- regressions --------------------------------------------------------------------------------------------------
def refused_at_initialize_after_the_windows() -> dict:
    """A training engine with the split policy refused at initialize because its model's heads do not allow the
    group (``split_workloads.refused_heads``): the refusal comes after its optimizer made the windows. Returns the
    error and every ODC segment the refusal left mapped in this process (the rank's own windows included: no engine
    survives a failed initialize)."""
    from tests.support.split_workloads import refused_heads

    before = resources()["mapped"]
    error = refused_heads()
    tdist.barrier()
    return {"error": error, "mapped": sorted(resources()["mapped"] - before)}
