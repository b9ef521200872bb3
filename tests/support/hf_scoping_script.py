"""Run under torchrun by ``test_hf_scoping.py``: what ds_odc does to transformers in a job that does not ask for ODC.

``sentinels``: before DeepSpeed (hence ds_odc, through the autoload) is imported, the Trainer's methods
are replaced by sentinels that count their calls and run the original; then a plain ZeRO-3 Trainer run.
Reports which sentinels ran and which attributes of ``Trainer`` and ``transformers.trainer`` are no
longer the objects installed: after the plain run, and again after a config has asked for the odc
stage (when ds_odc installs its one hook) and another plain Trainer was built.

``renamed``: transformers' own ``trainer.py`` loaded with ``_track_num_input_tokens`` renamed (a
release that lacks that method and calls its own), then a plain ZeRO-3 Trainer run, then Trainers on
an odc config with and without the balance block. Reports what each did.

Usage: ``hf_scoping_script.py MODE RESULTS_DIR``; each rank writes ``RESULTS_DIR/rank<r>.json``.
"""
import importlib.abc
import importlib.machinery
import importlib.util
import json
import os
import sys
import tempfile

MODE, RESULTS = sys.argv[1], sys.argv[2]
BALANCE_METHODS = ("get_train_dataloader", "get_batch_samples", "training_step", "floating_point_ops",
                   "_track_num_input_tokens", "log")
RENAMED, RENAMED_TO = "_track_num_input_tokens", "_count_input_tokens"


class _RenamedLoader(importlib.abc.Loader):
    """transformers/trainer.py, with ``RENAMED`` spelt ``RENAMED_TO`` everywhere in it."""

    def __init__(self, path):
        self.path = path

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        with open(self.path) as file:
            source = file.read().replace(RENAMED, RENAMED_TO)
        exec(compile(source, self.path, "exec"), module.__dict__)


class _ReleaseWithoutMethod(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name != "transformers.trainer":
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        return importlib.util.spec_from_file_location(name, spec.origin, loader=_RenamedLoader(spec.origin))


if MODE == "renamed":
    sys.meta_path.insert(0, _ReleaseWithoutMethod())

import transformers.trainer as tf_trainer  # noqa: E402

Trainer = tf_trainer.Trainer
calls: dict = {}
result: dict = {}


def _sentinel(owner, name):
    original = owner.__dict__[name]

    def sentinel(self, *args, **kwargs):
        calls[name] = calls.get(name, 0) + 1
        return original(self, *args, **kwargs)

    setattr(owner, name, sentinel)


if MODE == "sentinels":
    for method in ("__init__", "train", *BALANCE_METHODS):
        _sentinel(Trainer, method)
    from accelerate.utils.deepspeed import HfDeepSpeedConfig

    _sentinel(HfDeepSpeedConfig, "set_stage_and_offload")  # the method ds_odc wraps, as a pass-through
else:
    result["release_lacks_method"] = not hasattr(Trainer, RENAMED) and callable(getattr(Trainer, RENAMED_TO, None))
class_before, module_before = dict(vars(Trainer)), dict(vars(tf_trainer))


def _replaced(before: dict, now: dict) -> list:
    return sorted(name for name in set(before) | set(now) if before.get(name) is not now.get(name))


result["deepspeed_imported_first"] = "deepspeed" in sys.modules or "ds_odc" in sys.modules
import deepspeed  # noqa: E402  the autoload imports ds_odc here
import torch  # noqa: E402
from transformers import LlamaForCausalLM, TrainingArguments  # noqa: E402

from tests.support.hf_workloads import CountingDataset, tiny_llama_config, trainer_ds_config  # noqa: E402

result["ds_odc_imported"] = "ds_odc" in sys.modules
output = tempfile.mkdtemp(prefix="ds_odc_scoping_")


def _fresh_accelerate_state() -> None:
    """accelerate keeps one state per process; a second Trainer with a DeepSpeed config needs it reset."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state()
    GradientState._reset_state()


def _arguments(ds_config) -> TrainingArguments:
    return TrainingArguments(
        output_dir=output, deepspeed=ds_config, use_cpu=True, max_steps=2, per_device_train_batch_size=2,
        gradient_accumulation_steps=2, learning_rate=1e-3, logging_steps=1, save_strategy="no", report_to="none",
        seed=0, data_seed=0, disable_tqdm=True, dataloader_num_workers=0)


args = _arguments(trainer_ds_config(3))
deepspeed.init_distributed(dist_backend="gloo")
torch.manual_seed(0)
model = LlamaForCausalLM._from_config(tiny_llama_config())
trainer = Trainer(model=model, args=args, train_dataset=CountingDataset(16, seed=1))
trainer.train()
result.update(engine=type(trainer.model_wrapped).__name__, losses=[h["loss"] for h in trainer.state.log_history
                                                                   if "loss" in h])
result["bound_on_instance"] = sorted(name for name in ("train", *BALANCE_METHODS) if name in vars(trainer))
result["class_replaced"] = _replaced(class_before, dict(vars(Trainer)))
result["module_replaced"] = _replaced(module_before, dict(vars(tf_trainer)))

if MODE == "sentinels":
    result["calls"] = dict(calls)
    # a config asks for the odc stage: now (and only now) ds_odc installs its one hook, Trainer.__init__
    from accelerate.utils.deepspeed import HfDeepSpeedConfig

    HfDeepSpeedConfig({"zero_optimization": {"stage": "odc"}})
    result["class_replaced_after_odc_config"] = _replaced(class_before, dict(vars(Trainer)))
    result["hook_wraps_the_installed_init"] = Trainer.__init__.__wrapped__ is class_before["__init__"]
    _fresh_accelerate_state()
    again = Trainer(model=model, args=args, train_dataset=CountingDataset(16, seed=1))
    result["init_calls_after_odc_config"] = calls["__init__"]
    result["bound_on_plain_instance_after_odc_config"] = sorted(n for n in ("train", *BALANCE_METHODS)
                                                               if n in vars(again))
else:
    from ds_odc.errors import ODCConfigError

    for name, balance in (("odc", None), ("odc_balance", {"policy": "lb-mini", "token_cap": 64})):
        _fresh_accelerate_state()
        config = trainer_ds_config("odc")
        if balance is not None:
            config["zero_optimization"]["odc"]["balance"] = balance
        try:
            built = Trainer(model=LlamaForCausalLM(tiny_llama_config()), args=_arguments(config),
                            train_dataset=CountingDataset(16, seed=1))
            result[name] = {"built": True, "bound": sorted(n for n in ("train", *BALANCE_METHODS) if n in vars(built))}
        except ODCConfigError as error:
            result[name] = {"built": False, "error": str(error)}
    result["class_replaced_after_odc_config"] = _replaced(class_before, dict(vars(Trainer)))

with open(os.path.join(RESULTS, f"rank{os.environ['RANK']}.json"), "w") as file:
    json.dump(result, file)
deepspeed.comm.barrier()
