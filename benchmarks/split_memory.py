"""Per-rank peak memory of one long sample trained whole against split over 2 and 4 ranks (policy "lb-mini-split").

What splitting buys besides time: a sample longer than ``token_cap`` runs over the smallest group that brings each
member under the cap (``plan_split``), so each member holds about ``1/p`` of its activations. This measures it on
CPU ranks (gloo), one optimizer step on one sample of ``--length`` tokens, a small Llama whose activations dominate
its parameters (sdpa, hidden 512, 8 query and 8 key/value heads, vocabulary 256), per-token loss, AdamW:

* ``whole``: 2 ranks, ``token_cap`` = the length; rank 0 runs the sample whole, rank 1 has nothing this step;
* ``split-2``: 2 ranks, ``token_cap`` = half the length: the planner splits it over ranks 0-1;
* ``split-4``: 4 ranks, ``token_cap`` = a quarter: over ranks 0-3.

Every case is planned by ``plan_split`` (the split ones forced by the cap, the whole one kept whole by
``min_chunk_tokens``) and run in fresh processes (``benchmarks/cells.py``), one per repeat, so that each peak is
its own. Each rank reports:

* ``fwd_bwd_peak_mb``: the peak resident set during forward and backward, less the resident set just before
  (the kernel's peak, ``VmHWM`` of ``/proc/self/status``, reset by writing 5 to ``/proc/self/clear_refs``);
* ``step_peak_mb``: the same over forward, backward and ``engine.step`` (the first step also allocates AdamW's
  state for the rank's shard);
* ``saved_mb``: the bytes autograd saves for backward during the forward (activations, counted once per storage,
  parameters excluded), what a GPU would hold between forward and backward.

With ``--device cuda`` (the GPU kit's "split-memory" item; every rank on GPU 0, the ``cuda_ipc`` transport, the
all-to-alls on gloo groups) each rank also reports ``cuda_fwd_bwd_peak_mb``: ``torch.cuda.max_memory_allocated``
over forward and backward less what was allocated just before, the figure that decides whether a long sample fits.

Large tensors are returned to the system when freed (``MALLOC_MMAP_THRESHOLD_`` is fixed for the ranks, so glibc
maps every allocation over 64 KiB on its own), so the resident set follows what is live. Prints one JSON line
per case with the median over ``--repeats`` runs of each figure, per rank.

    DS_ACCELERATOR=cpu .venv/bin/python benchmarks/split_memory.py --length 8192 --repeats 3
    .venv/bin/python benchmarks/split_memory.py --device cuda --length 16384 --repeats 1 --json out.json
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT]

MODEL = dict(vocab_size=256, hidden_size=512, intermediate_size=1408, num_hidden_layers=2, num_attention_heads=8,
             num_key_value_heads=8)
CASES = {"whole": (2, 1), "split-2": (2, 2), "split-4": (4, 4)}  # name -> (ranks, group the sample runs over)
MMAP_THRESHOLD = 65536


def case_plan(case: str, length: int):
    """The case's plan, made by ``plan_split``; raises if the planner did not do what the case measures."""
    from ds_odc.balance import AllToAllCost, plan_split

    world, group = CASES[case]
    cap = math.ceil(length / group)
    # whole: min_chunk_tokens above half the length, so the planner has no reason to split a sample it may keep
    plan = plan_split([length], world, cap, all_to_all=AllToAllCost.free(), node_size=world, max_group=world,
                      min_chunk_tokens=length if group == 1 else 2048)
    runs_over = plan.splits[0].group_size if plan.splits else 1
    if runs_over != group:
        raise RuntimeError(f"{case}: the planner ran the sample over {runs_over} ranks, not {group}")
    return plan


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as refs:
        refs.write("5")  # the peak resident set (VmHWM) starts again from the current one


class SavedBytes:
    """Bytes autograd saves for backward, once per storage, leaves that need a gradient (parameters) excluded."""

    def __init__(self):
        self.storages: dict[int, int] = {}

    def pack(self, tensor):
        if not (tensor.is_leaf and tensor.requires_grad):
            storage = tensor.untyped_storage()
            self.storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    @property
    def megabytes(self) -> float:
        return sum(self.storages.values()) / 2 ** 20


def _model(length: int):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(**MODEL, max_position_embeddings=length + 8, tie_word_embeddings=False)
    config.use_cache = False
    config._attn_implementation = "sdpa"
    return LlamaForCausalLM(config)


def _run(rank: int, cell: dict) -> dict:
    import deepspeed
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    import ds_odc  # noqa: F401
    from ds_odc.balance import split_batch

    deepspeed.init_distributed(dist_backend="gloo")
    plan = cell["plan"]
    cuda = cell.get("device") == "cuda"
    if cuda:
        torch.cuda.set_device(0)  # every rank on GPU 0 (the kit's machine has one): per-process peaks
    model = _model(plan.lengths[0])
    if cuda:
        model = model.cuda()
    balance = {"policy": "lb-mini-split", "token_cap": plan.token_cap, "max_group": max(2, plan.world_size),
               "min_chunk_tokens": 1}
    config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
              "managed_gradient_accumulation": False, "steps_per_print": 10 ** 9,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}},
              "zero_optimization": {"stage": "odc", "odc": {"balance": balance}}}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    ids = torch.randint(0, MODEL["vocab_size"], (1, plan.lengths[0]), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "labels": ids.clone(), "position_ids": torch.arange(ids.shape[1]).unsqueeze(0)}
    if cuda:
        batch = {key: value.cuda() for key, value in batch.items()}
    saved = SavedBytes()
    dist.barrier()
    before = _status_kb("VmRSS")
    _reset_peak()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        cuda_before = torch.cuda.memory_allocated()
    start = time.perf_counter()
    for entry in plan.for_rank(rank):
        part = split_batch(batch, entry, rank)
        with engine.odc_micro_batch(entry), torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda t: t):
            logits = engine(input_ids=part["input_ids"], position_ids=part["position_ids"]).logits.float()
            labels = part["shift_labels"]
            loss = F.cross_entropy(logits.reshape(-1, MODEL["vocab_size"]), labels.reshape(-1), reduction="sum")
            del logits
            engine.backward(loss, loss_tokens=int((labels != -100).sum()))
    if cuda:
        torch.cuda.synchronize()
        cuda_peak = (torch.cuda.max_memory_allocated() - cuda_before) / 2 ** 20
    fwd_bwd = _status_kb("VmHWM")
    compute_s = time.perf_counter() - start
    engine.step()
    step = _status_kb("VmHWM")
    dist.barrier()
    engine.destroy()
    result = {"rss_before_mb": before / 1024, "fwd_bwd_peak_mb": (fwd_bwd - before) / 1024,
              "step_peak_mb": (step - before) / 1024, "saved_mb": saved.megabytes, "compute_s": compute_s,
              "tokens": sum(math.ceil(plan.lengths[i] / len(e.ranks)) for e in plan.for_rank(rank) for i in e.samples)}
    if cuda:
        result["cuda_fwd_bwd_peak_mb"] = cuda_peak
    return result


def measure(case: str, length: int, repeats: int, device: str = "cpu") -> dict:
    """Median of each per-rank figure over ``repeats`` runs of the case, each in fresh processes."""
    from benchmarks import cells

    plan = case_plan(case, length)
    runs = [cells.run_cell(_run, plan.world_size, {"plan": plan, "device": device}, f"{case} run {k}",
                           timeout_s=1800) for k in range(repeats)]
    figures = ("fwd_bwd_peak_mb", "step_peak_mb", "saved_mb", "rss_before_mb", "compute_s", "tokens")
    figures += ("cuda_fwd_bwd_peak_mb",) if device == "cuda" else ()
    per_rank = {name: [round(statistics.median(run[rank][name] for run in runs), 1)
                       for rank in range(plan.world_size)] for name in figures}
    return {"case": case, "length": length, "token_cap": plan.token_cap, "ranks": plan.world_size,
            "repeats": repeats, **per_rank}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--length", type=int, default=8192, help="tokens of the one sample (default 8192)")
    parser.add_argument("--repeats", type=int, default=3, help="fresh runs per case; figures are medians")
    parser.add_argument("--case", choices=tuple(CASES), action="append",
                        help="a case to run (repeatable; default: all three)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where the model runs")
    parser.add_argument("--json", help="also write every case's figures here (a list)")
    args = parser.parse_args(argv)
    os.environ["MALLOC_MMAP_THRESHOLD_"] = str(MMAP_THRESHOLD)  # read by glibc when each rank starts
    results = []
    for case in args.case or CASES:
        results.append(measure(case, args.length, args.repeats, args.device))
        print(json.dumps(results[-1]), flush=True)
    if args.json:
        with open(args.json, "w") as out:
            json.dump(results, out, indent=1)


if __name__ == "__main__":
    main()
