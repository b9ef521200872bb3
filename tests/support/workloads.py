"""What the ranks run in the distributed tests: a small model, deterministic data, probes.

Everything here runs inside spawned ranks (see harness.py) except :func:`reference_training`,
the single-process reference the parent computes.
"""
from __future__ import annotations

import time

import deepspeed
import torch
import torch.distributed as tdist
from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_grad

IN, OUT = 5, 3


class Net(torch.nn.Module):
    """Odd element counts (shards get padding), an optional frozen layer, ``layers`` hidden blocks."""

    def __init__(self, layers: int = 2, hidden: int = 7, frozen: bool = True):
        super().__init__()
        self.inp = torch.nn.Linear(IN, hidden)
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(hidden, hidden) for _ in range(layers))
        self.frozen = torch.nn.Linear(hidden, hidden) if frozen else None
        if self.frozen is not None:
            self.frozen.requires_grad_(False)
        self.out = torch.nn.Linear(hidden, OUT, bias=False)

    def forward(self, x):
        h = torch.tanh(self.inp(x))
        for block in self.blocks:
            h = torch.tanh(block(h))
        if self.frozen is not None:
            h = h + torch.tanh(self.frozen(h))
        return self.out(h)


def make_model(seed: int = 1234, **kw) -> Net:
    torch.manual_seed(seed)
    return Net(**kw)


def micro_batch(step: int, rank: int, index: int, size: int = 4, masked_out: bool = False):
    """Deterministic (x, y, mask) for micro-batch ``index`` of ``rank`` at ``step``."""
    gen = torch.Generator().manual_seed(10_000 * step + 100 * rank + index + 1)
    x = torch.randn(size, IN, generator=gen)
    y = torch.randn(size, OUT, generator=gen)
    mask = (torch.rand(size, generator=gen) > 0.3).float()
    if masked_out:
        mask.zero_()
    return x, y, mask


def mse_mean(pred, y):
    return ((pred.float() - y) ** 2).mean()


def mse_token_sum(pred, y, mask):
    return (((pred.float() - y) ** 2).sum(-1) * mask).sum()


def ds_config(stage, *, gas=1, micro=4, optimizer="adam", bf16=False, clip=1.0, managed=True, lr=1e-2,
              scheduler=False, **zero):
    if stage != "odc":
        zero.pop("odc", None)
    opt = {"adam": {"type": "Adam", "params": {"lr": lr, "torch_adam": True, "weight_decay": 0.0}},
           "adamw": {"type": "AdamW", "params": {"lr": lr, "torch_adam": True, "weight_decay": 0.1}},
           "sgd": {"type": "SGD", "params": {"lr": lr, "momentum": 0.9}},
           "client": None}[optimizer]
    cfg = {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": gas, "optimizer": opt,
           "gradient_clipping": clip, "steps_per_print": 10_000, "wall_clock_breakdown": False,
           "zero_optimization": {"stage": stage, **zero}, "zero_allow_untested_optimizer": True}
    if opt is None:
        del cfg["optimizer"]
    if scheduler:
        cfg["scheduler"] = {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": lr,
                                                           "warmup_num_steps": 5}}
    if bf16:
        cfg["bf16"] = {"enabled": True}
    if not managed:
        cfg["managed_gradient_accumulation"] = False
    return cfg


# -- probes ------------------------------------------------------------------------------------------
class GradProbe:
    """Captures each rank's normalised, pre-clip fp32 gradient shards inside the optimizer step, the
    same way for ZeRO-3 and ODC, and assembles full gradients."""

    def __init__(self, engine):
        self.engine = engine
        self.shards = {}
        optimizer = engine.optimizer
        original = optimizer.unscale_and_clip_grads

        def capture(sub_group_id, total_norm):
            self.shards[sub_group_id] = optimizer.fp32_partitioned_groups_flat[sub_group_id].grad.detach().clone()
            return original(sub_group_id, total_norm)

        optimizer.unscale_and_clip_grads = capture

    def full_grads(self):
        names = {id(p): n for n, p in self.engine.module.named_parameters()}
        world = tdist.get_world_size()
        grads = {}
        for sub_group_id, group in enumerate(self.engine.optimizer.fp16_groups):
            shard = self.shards[sub_group_id]
            gathered = [torch.empty_like(shard) for _ in range(world)]
            tdist.all_gather(gathered, shard)
            offset = 0
            for param in group:
                pn = param.partition_numel()
                grads[names[id(param)]] = torch.cat([g[offset:offset + pn] for g in gathered])[:param.ds_numel]
                offset += pn
        self.shards = {}
        return grads


def full_params(engine):
    """Full fp32 master weights of trainable params and gathered frozen ones, by name."""
    out = {}
    for name, param in engine.module.named_parameters():
        if param.requires_grad:
            out[name] = safe_get_full_fp32_param(param).detach().clone().reshape(param.ds_shape)
        else:
            with deepspeed.zero.GatheredParameters([param]):
                out[name] = param.detach().float().clone()
    return out


def summed_grads(engine) -> dict:
    """The full summed gradients the next step reads, by name (``safe_get_full_grad``, a collective: every rank
    calls it before the step). For bit-for-bit claims: parameters alone cannot show a sum's last bits, as an
    update far below a parameter's own last bit leaves it unchanged."""
    return {name: safe_get_full_grad(param).detach().cpu().clone()
            for name, param in engine.module.named_parameters() if param.requires_grad}


# -- workloads -----------------------------------------------------------------------------------
def train_equal(stage, steps=10, gas=1, model_kw=None, torch_style=False, **cfg_kw):
    """Managed accumulation, equal micro-batches everywhere. Returns per-step losses of this rank;
    rank 0 also returns full grads and params of every step. ``torch_style``: ``loss.backward()``
    instead of ``engine.backward(loss)`` (the path accelerate's DDP-style code takes)."""
    model_kw = dict(model_kw or {})
    config = ds_config(stage, gas=gas, **cfg_kw)
    if model_kw.pop("zero_init", False):  # parameters partitioned at construction
        with deepspeed.zero.Init(config_dict_or_path=config):
            model = make_model(**model_kw)
    else:
        model = make_model(**model_kw)
    client = None
    if cfg_kw.get("optimizer") == "client":  # a torch optimizer built by the caller, two param groups
        weights = [p for n, p in model.named_parameters() if p.requires_grad and n.endswith("weight")]
        biases = [p for n, p in model.named_parameters() if p.requires_grad and n.endswith("bias")]
        client = torch.optim.AdamW([{"params": weights, "lr": 1e-2, "weight_decay": 0.1},
                                    {"params": biases, "lr": 3e-3, "weight_decay": 0.0}])
    engine, *_ = deepspeed.initialize(model=model, optimizer=client, config=config)
    probe = GradProbe(engine)
    rank = tdist.get_rank()
    record = {"engine": type(engine).__name__, "losses": [], "grads": [], "params": []}
    record.update(odc_runtime_facts(engine))  # what pulls read and pushes add into; the layout across nodes
    gradients = engine.optimizer.grad_partitions_flat_buffer  # ZeRO-3's gradient partitions (ODC: its accumulator)
    record["gradient_bytes"] = gradients.numel() * gradients.element_size()
    for step in range(steps):
        for index in range(gas):
            x, y, _ = micro_batch(step, rank, index)
            loss = mse_mean(engine(x.to(engine.module.inp.weight.dtype)), y)
            loss.backward() if torch_style else engine.backward(loss)
            engine.step()
            record["losses"].append(loss.item())
        grads, params = probe.full_grads(), full_params(engine)
        if rank == 0:
            record["grads"].append(grads)
            record["params"].append(params)
    engine.destroy()
    return record


def train_pair(configs, steps=10, gas=1, model_kw=None, torch_style=False):
    """Run several (stage, cfg_kw) configurations one after the other in the same ranks."""
    return [train_equal(stage, steps=steps, gas=gas, model_kw=model_kw, torch_style=torch_style, **kw)
            for stage, kw in configs]


#: What jobs compared with :func:`reference_training` train with (:func:`train_uneven` and the others that
#: compare with it): SGD without clipping, under which a gradient off by a factor moves every parameter by that
#: factor. Adam divides each element by its own size and clipping rescales the norm: under them a wrong divisor
#: (a count missed across nodes, an idle rank counted, a third of the gradient) moved parameters by less than
#: the 1e-6 bar.
REFERENCE_OPTIMIZER = "sgd"
REFERENCE_CLIP = 0.0


def train_uneven(stage, mode, counts, steps=3, masked=(), gas=2, timeout_s=None, odc=None, bf16=False,
                 optimizer=REFERENCE_OPTIMIZER, clip=REFERENCE_CLIP, record_grads=False):
    """Ranks run ``counts[rank]`` micro-batches per step.

    mode "unmanaged": ``managed_gradient_accumulation: false``, ``engine.backward(loss)``;
    mode "managed": each rank sets the boundary on its own last micro-batch (accelerate's pattern);
    mode "token": unmanaged, per-token loss sums with ``loss_tokens``; ``masked`` lists (rank, index) whose
    micro-batch carries zero loss tokens. Records, besides the parameters, the cross_node mode the odc stage
    resolved to and its windows' dtypes (what a test asks for is what ran). ``record_grads``: also the summed
    gradients each step reads (:func:`summed_grads`; "managed" needs every rank at one micro-batch or more)."""
    rank = tdist.get_rank()
    managed = mode == "managed"
    options = {**({"timeout_s": timeout_s} if timeout_s else {}), **(odc or {})}
    zero = {"odc": options} if (options and stage == "odc") else {}
    cfg = ds_config(stage, gas=gas if managed else 1, managed=managed, bf16=bf16, optimizer=optimizer, clip=clip,
                    **zero)
    engine, *_ = deepspeed.initialize(model=make_model(), config=cfg)
    dtype = torch.bfloat16 if bf16 else torch.float32
    grads: list = []
    for step in range(steps):
        n = counts[rank]
        for index in range(n):
            x, y, mask = micro_batch(step, rank, index, masked_out=(rank, index) in masked)
            if mode == "managed":
                engine.set_gradient_accumulation_boundary(index == n - 1)
            pred = engine(x.to(dtype))
            if mode == "token":
                engine.backward(mse_token_sum(pred, y, mask), loss_tokens=int(mask.sum().item()))
            else:
                engine.backward(mse_mean(pred, y))
            if mode == "managed":
                if record_grads and index == n - 1:  # the boundary: this step() is the optimizer's
                    grads.append(summed_grads(engine))
                engine.step()
        if mode != "managed":
            if record_grads:
                grads.append(summed_grads(engine))
            engine.step()
    params = full_params(engine)
    result = {"params": params, "grads": grads, "global_samples": engine.global_samples,
              "phase": getattr(engine, "odc_phase", None), **odc_runtime_facts(engine)}
    result["phase"] = result["phase"].value if result["phase"] is not None else None
    engine.destroy()
    return result


def odc_runtime_facts(engine) -> dict:
    """The odc stage's resolved cross_node mode ("replicate" on one node) and its windows' dtypes; empty on
    another stage."""
    runtime = getattr(engine.optimizer, "odc", None)
    if runtime is None:
        return {}
    choice = runtime.cross_node
    return {"cross_node": "replicate" if choice is None else choice.mode,
            "window_dtypes": (str(runtime.transport.local_param_window().dtype),
                              str(runtime.transport.local_grad_accumulator().dtype))}


def train_uneven_each(odc_options, bf16, mode, counts, steps=3, masked=(), optimizer=REFERENCE_OPTIMIZER,
                      clip=REFERENCE_CLIP, record_grads=False):
    """:func:`train_uneven` on the odc stage once per entry of ``odc_options`` (its ``odc`` argument), in the
    same ranks."""
    return [train_uneven("odc", mode, counts, steps, masked, odc=options, bf16=bf16, optimizer=optimizer, clip=clip,
                         record_grads=record_grads)
            for options in odc_options]


def reference_training(mode, counts, steps=3, masked=(), lr=1e-2, clip=REFERENCE_CLIP, optimizer=REFERENCE_OPTIMIZER,
                       scale=1.0):
    """Single process, plain PyTorch: the update each step is computed on the global batch of all
    ranks' micro-batches with the rule of ``mode``; ``optimizer`` and ``clip`` as :func:`ds_config` builds them
    ("sgd": momentum 0.9; "adam": torch's Adam, no weight decay; clip 0: none). ``scale`` multiplies every
    gradient: a control, what a wrong divisor would train."""
    model = make_model()
    trained = [p for p in model.parameters() if p.requires_grad]
    optimizer = (torch.optim.SGD(trained, lr=lr, momentum=0.9) if optimizer == "sgd"
                 else torch.optim.AdamW(trained, lr=lr, weight_decay=0.0))
    world = len(counts)
    for step in range(steps):
        optimizer.zero_grad()
        batches = [(r, i) for r in range(world) for i in range(counts[r])]
        total_tokens = 0
        for r, i in batches:
            x, y, mask = micro_batch(step, r, i, masked_out=(r, i) in masked)
            pred = model(x)
            if mode == "token":
                mse_token_sum(pred, y, mask).backward()
                total_tokens += int(mask.sum().item())
            else:
                mse_mean(pred, y).backward()
        divisor = {"unmanaged": world, "managed": len(batches), "token": max(total_tokens, 1)}[mode] / scale
        for p in model.parameters():
            if p.grad is not None:
                p.grad.div_(divisor)
        if clip > 0:
            clip_like_deepspeed(model, clip)
        optimizer.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def clip_like_deepspeed(model, clip):
    """ZeRO-3's clipping arithmetic: scale by max((‖g‖ + 1e-6) / clip, 1)."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    norm = torch.stack([g.norm(2) for g in grads]).pow(2).sum().sqrt()
    scale = max(((norm + 1e-6) / clip).item(), 1.0)
    for g in grads:
        g.mul_(1.0 / scale)


# -- checkpoints ------------------------------------------------------------------------------------
def _train_steps(engine, first_step, steps):
    rank = tdist.get_rank()
    losses = []
    for step in range(first_step, first_step + steps):
        x, y, _ = micro_batch(step, rank, 0)
        loss = mse_mean(engine(x), y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def checkpoint_roundtrip(ckpt_dir, stage="odc"):
    """Save after 3 steps, train 2 more; a fresh engine (other initial weights) loads the checkpoint
    and trains the same 2 steps. Rank 0 also consolidates the checkpoint with zero_to_fp32."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    first, *_ = deepspeed.initialize(model=make_model(), config=ds_config(stage))
    _train_steps(first, 0, 3)
    first.save_checkpoint(ckpt_dir, tag="step3")
    saved = full_params(first)
    continued = _train_steps(first, 3, 2)
    final = full_params(first)
    first.destroy()

    second, *_ = deepspeed.initialize(model=make_model(seed=999), config=ds_config(stage))
    second.load_checkpoint(ckpt_dir, tag="step3")
    loaded = full_params(second)
    resumed = _train_steps(second, 3, 2)
    resumed_final = full_params(second)
    result = {"saved": saved, "loaded": loaded, "continued": continued, "resumed": resumed, "final": final,
              "resumed_final": resumed_final, "engine": type(second).__name__}
    second.destroy()
    if tdist.get_rank() == 0:
        result["zero_to_fp32"] = {k: v.float() for k, v in
                                  get_fp32_state_dict_from_zero_checkpoint(ckpt_dir, tag="step3").items()}
    tdist.barrier()
    return result


# -- failures -------------------------------------------------------------------------------------
def peer_failure(how, timeout_s):
    """In step 1, rank 1 dies (``how="killed"``), stalls (``"stalled"``), or is slow but alive
    (``"slow"``: it sleeps 0.6 x timeout before each module, pulling parameters in between, for
    3 x timeout in all). Rank 0 reports the error it gets at the step (if any) and how long it waited."""
    import os
    import signal

    cfg = ds_config("odc", odc={"timeout_s": timeout_s}, stage3_param_persistence_threshold=0)
    engine, *_ = deepspeed.initialize(model=make_model(), config=cfg)
    rank = tdist.get_rank()
    _train_steps(engine, 0, 1)
    if rank == 1:
        if how == "killed":
            os.kill(os.getpid(), signal.SIGKILL)
        elif how == "stalled":
            time.sleep(3600)
        else:
            for module in (engine.module.inp, *engine.module.blocks, engine.module.frozen, engine.module.out):
                module.register_forward_pre_hook(lambda *_: time.sleep(0.6 * timeout_s))
    x, y, _ = micro_batch(1, rank, 0)
    engine.backward(mse_mean(engine(x), y))
    start = time.monotonic()
    try:
        engine.step()
    except Exception as err:  # noqa: BLE001 - the error is the result
        return {"error": type(err).__name__, "message": str(err), "waited_s": time.monotonic() - start}
    return {"error": None}


def bad_configs(cases):
    """Try to initialize each (name, config) and return the error message (or None)."""
    messages = {}
    for name, cfg in cases:
        try:
            engine, *_ = deepspeed.initialize(model=make_model(), config=cfg)
            engine.destroy()
            messages[name] = None
        except Exception as err:  # noqa: BLE001
            messages[name] = f"{type(err).__name__}: {err}"
    return messages


# -- registration -----------------------------------------------------------------------------------
def engine_kinds(config_path):
    """Which engine deepspeed.initialize builds for each way of passing a config."""
    import argparse
    import json

    kinds = {}

    def describe(engine):
        kinds_entry = (type(engine).__name__, engine.zero_optimization_stage(), type(engine.optimizer).__name__)
        engine.destroy()
        return kinds_entry

    kinds["dict"] = describe(deepspeed.initialize(model=make_model(), config=ds_config("odc"))[0])
    kinds["path"] = describe(deepspeed.initialize(model=make_model(), config=config_path)[0])
    args = argparse.Namespace(deepspeed_config=config_path)
    kinds["args"] = describe(deepspeed.initialize(args=args, model=make_model())[0])
    kinds["args_restored"] = args.deepspeed_config == config_path
    kinds["config_params"] = describe(deepspeed.initialize(model=make_model(), config_params=ds_config("odc"))[0])
    kinds["stage3"] = describe(deepspeed.initialize(model=make_model(), config=ds_config(3))[0])
    with open(config_path) as config_file:
        kinds["file_untouched"] = json.load(config_file)["zero_optimization"]["stage"] == "odc"
    return kinds


def hang_on_rank(rank_to_hang):
    if tdist.get_rank() == rank_to_hang:
        time.sleep(3600)
    return "done"


def modify_under_gathered_parameters():
    """Rank 0 rewrites a weight under GatheredParameters(modifier_rank=0); every rank then reads
    it back through a pull and through a forward pass."""
    engine, *_ = deepspeed.initialize(model=make_model(), config=ds_config("odc"))
    weight = engine.module.blocks[0].weight
    with deepspeed.zero.GatheredParameters([weight], modifier_rank=0):
        if tdist.get_rank() == 0:
            weight.data.fill_(0.5)
    with deepspeed.zero.GatheredParameters([weight]):
        seen = weight.detach().clone()
    loss = mse_mean(engine(micro_batch(0, 0, 0)[0]), micro_batch(0, 0, 0)[1]).item()
    _train_steps(engine, 0, 2)
    before_destroy = full_params(engine)["out.weight"]
    module = engine.module
    engine.destroy()
    with deepspeed.zero.GatheredParameters([module.out.weight]):  # ZeRO-3's own gather again
        after_destroy = module.out.weight.detach().clone()
    return {"seen": seen, "loss": loss, "before_destroy": before_destroy, "after_destroy": after_destroy}
