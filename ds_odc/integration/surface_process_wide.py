"""Every process-wide effect ds_odc has, and every replacement it makes on objects it does not own
(:data:`PROCESS_WIDE`): what, for how long, and why it cannot be narrower. Data only; re-exported by
:mod:`ds_odc.integration.surface_table`."""
from __future__ import annotations

from ds_odc.integration.surface_types import (
    BALANCE,
    CKPT,
    ENGINE,
    HF,
    INIT,
    METRICS,
    PARAMS,
    SPLIT,
    TRAINER,
    ProcessWide,
)

#: Every process-wide effect of ds_odc, and every replacement it makes on objects it does not own (parameters,
#: DeepSpeed's coordinators and optimizers, an engine ``ds_odc.metrics.attach`` is given). Each replacement
#: delegates unchanged to the original for anything that is not an ODC job; the scoped swaps last one call and
#: are restored on every exit path; the others are undone by ``destroy()`` or when the process ends, as stated.
#: Each is made through ``patching.py`` (``tests/unit/test_patching.py`` holds every file that patches to a line).
PROCESS_WIDE: tuple[ProcessWide, ...] = (
    ProcessWide("deepspeed.initialize replaced", "while ds_odc is registered (import ds_odc, or autoload)",
                "the one entry every launcher, accelerate and the HF Trainer go through; configs without the odc "
                "stage run the original unchanged", INIT),
    ProcessWide("deepspeed.runtime.config.get_zero_config replaced", "while ds_odc is registered",
                "zero.Init(config_dict_or_path=<odc dict>) and other raw readers parse the dict; it works on a copy "
                "and leaves every other dict to the original", INIT),
    ProcessWide("deepspeed.DeepSpeedEngine swapped for ODCEngine", "one deepspeed.initialize call of an odc config",
                "initialize looks the engine class up at call time", INIT),
    ProcessWide("deepspeed.runtime.zero.stage3.DeepSpeedZeroOptimizer_Stage3 swapped", "one _configure_zero_optimizer "
                "call of an ODC engine", "DeepSpeed imports the class at call time and passes ~45 arguments", ENGINE),
    ProcessWide("deepspeed.comm.barrier swapped for an ODC round", "one save_checkpoint call of an ODC engine",
                "DeepSpeed's save barriers must fail fast when a peer died", CKPT),
    ProcessWide("partitioned_param_coordinator.assert_ints_same_as_other_ranks gated",
                "while ODC engines' parameter coordinators exist", "only ODC coordinators skip the trace check; "
                "every other coordinator's call goes to the original", PARAMS),
    ProcessWide("an ODC engine's parameter coordinator: reset_step replaced by one that skips the trace check",
                "from the engine's build to its destroy()", "ranks of an ODC job keep their own trace; the "
                "instance attribute reaches this coordinator only", PARAMS),
    ProcessWide("each partitioned parameter's all_gather, all_gather_coalesced and partition closures replaced "
                "by pulls", "from an ODC engine's build to its destroy() (ZeRO-3's closures put back)",
                "zero.Init attaches these closures to every parameter, and they are the only way the coordinator, "
                "GatheredParameters and the persistent-parameter refresh gather", PARAMS),
    ProcessWide("the step recorder's hooks on one engine: its forward, backward, step and destroy, its optimizer's "
                "reduce, norm, overflow and post-step methods, its coordinator's fetch_sub_module, its protocol's "
                "round", "from the recorder's attach (an ODC engine's build, or ds_odc.metrics.attach) to the "
                "engine's destroy()", "the recorder listens where ZeRO-3 works, on that engine's objects only "
                "(no class is patched)", METRICS),
    ProcessWide("torch.distributed.destroy_process_group replaced", "from the first ODC engine's build to the end of "
                "the process (a pass-through while no ODC engine is alive)", "a rank that tears its process group "
                "down with an ODC engine open has left training: its peers, waiting at a round, learn of it at once "
                "instead of at their no-progress bound", "ds_odc/integration/clean_exit.py"),
    ProcessWide("an ODC engine's model: its generate bound on the instance (synced_gpus False unless the caller "
                "says)", "from the engine's build to its destroy()", "transformers syncs every model's generation "
                "while a ZeRO-3 config is active; an ODC model's forwards are one-sided, so only that instance "
                "stops syncing (the class and every other model are left alone)",
                "ds_odc/integration/hf_generation.py"),
    ProcessWide("SIGTERM, SIGINT and SIGHUP handlers: first unlink the files this rank created, then the previous "
                "handler (or the default action)", "while a node's windows are allocated, main thread only; the "
                "previous handlers are put back on every exit, and a signal the process ignores stays ignored",
                "a rank stopped while allocating must leave nothing in /dev/shm (after allocation the files are "
                "already unlinked)", "ds_odc/comm/segments.py"),
    ProcessWide("accelerate's HfDeepSpeedConfig.set_stage_and_offload replaced", "once accelerate.utils.deepspeed is "
                "imported (by the autoload's guard before ds_odc is imported)", "the one reader from which "
                "transformers and accelerate learn the stage: a config mentioning odc is canonicalised in place (stage "
                "3 plus the marker); every other config goes straight to accelerate's method", HF),
    ProcessWide("transformers' Trainer.__init__ replaced by a pass-through", "once a config asked for odc and "
                "transformers.trainer is imported (never in a job that does not use ODC)", "the only place every "
                "Trainer passes through; it binds ODC behaviour on the instances whose config asks for it, and leaves "
                "the class and every other Trainer exactly as transformers has them", TRAINER),
    ProcessWide("methods bound on one Trainer instance whose config asks for odc: train (the inference engine "
                "released first), and with the balance block the slot behaviours (get_train_dataloader, "
                "get_batch_samples, training_step, ...); under SP its accelerator's deepspeed_ulysses_dl_adapter",
                "that Trainer's life", "the class and every other Trainer stay as transformers and accelerate have "
                "them; each bound method delegates to the class's own", f"{TRAINER}, {BALANCE}, "
                "ds_odc/integration/hf_sequence_parallel.py"),
    ProcessWide("a balanced Trainer's args.average_tokens_across_devices, and its accelerator's gather and "
                "gather_for_metrics, swapped", "one call (the loss-token count; one balanced micro-batch)",
                "the Trainer's own count without its per-rank gather; a gather per micro-batch cannot be "
                "collective when ranks run different counts", BALANCE),
    ProcessWide("ACCELERATE_DEEPSPEED_ZERO_STAGE=odc rewritten to 3, with DS_ODC_STAGE3=odc set",
                "the process and its children (only when the variable says odc)", "accelerate calls int() on it; "
                "axolotl exports there the stage it is given", "ds_odc_import_hooks.py (at interpreter start by "
                "ds_odc_autoload.py, and when ds_odc registers)"),
    ProcessWide("deepspeed.launcher.runner.EXPORT_ENVS gains DS_ODC_", "the launcher process",
                "the environment switch must reach the ranks of every node the launcher starts",
                "ds_odc/integration/__init__.py"),
    ProcessWide("the sequence-parallel lockstep of the newest training ODC engine under an SP mpu",
                "from that engine's build to its destroy()", "ALST replaces the attention function process-wide, so "
                "a frozen model's forward (a DPO reference) meets the SP peers in all-to-alls too: it takes the same "
                "lockstep as the training engine's forwards", "ds_odc/integration/sequence_parallel.py"),
    ProcessWide("sys.excepthook chained", "while ODC engines live (restored when the last one closes)",
                "an uncaught exception reaches the peers as that exception, not as a bare exit",
                "ds_odc/runtime/crash.py"),
    ProcessWide("an atexit hook", "the process (DS_ODC_CLEAN_EXIT=0: none)", "gloo workers finish their last "
                "decref before finalisation; no collective, bounded wait", "ds_odc/integration/clean_exit.py"),
    ProcessWide("a post-import finder on sys.meta_path", "until the modules it waits for are imported",
                "ds_odc patches accelerate and transformers only once a program imports them",
                "ds_odc_import_hooks.py"),
    ProcessWide("transformers' ALL_ATTENTION_FUNCTIONS entry of the model's attention implementation (e.g. 'sdpa') "
                "replaced by the split dispatcher (the original for a whole micro-batch, Ulysses over the group inside "
                "a split one)", "from the build of an ODC engine with balance policy 'lb-mini-split' to its "
                "destroy()", "transformers looks the attention function up there at every call, and ALST hooks the "
                "same entry; a frozen model's forward inside a split micro-batch (a reference model) must meet the "
                "members too", SPLIT),
)
