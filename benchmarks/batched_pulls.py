"""Batched pulls (one ``read_many`` per ZeRO-3 gather) against one pull per parameter, on ODC.

    .venv/bin/python benchmarks/batched_pulls.py --pull batched      # one 2-rank run, prints RESULT {...}
    .venv/bin/python benchmarks/batched_pulls.py --pull per-param    # the same run, one pull per parameter
    .venv/bin/python benchmarks/batched_pulls.py --compare           # both, alternating, a markdown table

Model: a small LlamaForCausalLM built from a config (no download): 8 layers, hidden size 64, 75
parameter tensors, every one partitioned (``stage3_param_persistence_threshold: 0``), so every
forward and backward pulls all of them, mostly through ZeRO-3's prefetch, which gathers several
modules' parameters in one call. 2 CPU ranks (gloo, shm transport), one 64-token sequence per
micro-batch, one micro-batch per step, AdamW. Per rank: the median time spent in the gathers' pulls
per step, the median step (forward + backward + step) and forward time over ``--steps`` steps after 3
warm-up steps, and the transport calls per step. ``--compare`` reports, per mode, the median over
runs of the slower rank's medians.

``--pull per-param`` replaces the gather's batched pull with the one it replaced (``runtime.pull``
per parameter, one ``transport.read`` per owner per parameter), inside this script only. The
whole-process figures in docs/benchmarks.md time this script as a whole, alternating the two modes.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time

LAYERS, HIDDEN, SEQ, VOCAB = 8, 64, 64, 256


def _per_parameter_pulls():
    """The gather as it was before batching: one ``runtime.pull`` per parameter."""
    import torch

    from ds_odc.comm.batch import COMPLETED
    from ds_odc.integration import zero3_params

    def pull_one_by_one(runtime, params):
        for param in params:
            full = torch.empty(param.ds_numel, dtype=param.ds_tensor.dtype, device=param.ds_tensor.device)
            runtime.pull(param.ds_id, full)
            param.data = full.view(param.ds_shape)
        return COMPLETED

    zero3_params._pull_params = pull_one_by_one


def _timed_gathers():
    """Seconds spent in the gathers' pulls (either mode), accumulated: ``spent[0]``."""
    from ds_odc.integration import zero3_params

    spent, pull = [0.0], zero3_params._pull_params

    def timed(runtime, params):
        start = time.perf_counter()
        handle = pull(runtime, params)
        handle.wait()
        spent[0] += time.perf_counter() - start
        return handle

    zero3_params._pull_params = timed
    return spent


def _count_calls(transport, names):
    counts = dict.fromkeys(names, 0)
    for name in names:
        original = getattr(transport, name)

        def counted(*args, _name=name, _original=original, **kwargs):
            counts[_name] += 1
            return _original(*args, **kwargs)

        setattr(transport, name, counted)
    return counts


def rank_main(pull: str, steps: int, warmup: int = 3):
    import deepspeed
    import torch
    from deepspeed import comm as dist
    from transformers import LlamaConfig, LlamaForCausalLM

    import ds_odc  # noqa: F401

    torch.set_num_threads(1)
    if pull == "per-param":
        _per_parameter_pulls()
    pull_time = _timed_gathers()
    deepspeed.init_distributed(dist_backend="gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN,
                                         num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=4,
                                         max_position_embeddings=SEQ, tie_word_embeddings=False))
    tensors = len(list(model.parameters()))
    config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
              "steps_per_print": 10**9,
              "zero_optimization": {"stage": "odc", "stage3_param_persistence_threshold": 0}}
    engine, *_ = deepspeed.initialize(model=model, config=config)
    calls = _count_calls(engine.optimizer.odc.transport, ("read", "read_many"))
    step_s, forward_s, pull_s, losses = [], [], [], []
    for step in range(warmup + steps):
        tokens = torch.randint(0, VOCAB, (1, SEQ), generator=torch.Generator().manual_seed(step * 2 + rank))
        before, pulled = dict(calls), pull_time[0]
        start = time.perf_counter()
        loss = engine(input_ids=tokens, labels=tokens).loss
        forwarded = time.perf_counter()
        engine.backward(loss)
        engine.step()
        if step >= warmup:
            step_s.append(time.perf_counter() - start)
            forward_s.append(forwarded - start)
            pull_s.append(pull_time[0] - pulled)
        losses.append(loss.item())
    per_step = {name: calls[name] - before[name] for name in calls}
    result = {"rank": rank, "pull": pull, "tensors": tensors, "step_ms": 1e3 * statistics.median(step_s),
              "forward_ms": 1e3 * statistics.median(forward_s), "pull_ms": 1e3 * statistics.median(pull_s),
              "transport_calls_per_step": per_step,
              "last_loss": losses[-1]}
    engine.destroy()
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, result)
    if rank == 0:
        print("RESULT " + json.dumps(gathered), flush=True)


def run(pull: str, steps: int, port: int):
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(port),
           os.path.abspath(__file__), "--rank-main", "--pull", pull, "--steps", str(steps)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if done.returncode:
        sys.exit(done.stdout[-3000:] + done.stderr[-3000:])
    return json.loads(next(line for line in done.stdout.splitlines() if line.startswith("RESULT "))[7:])


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pull", choices=("batched", "per-param"), default="batched")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--compare", action="store_true", help="run both modes --repeats times, alternating")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--port", type=int, default=29650)
    parser.add_argument("--rank-main", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank_main:
        rank_main(args.pull, args.steps)
        return
    if not args.compare:
        print("RESULT " + json.dumps(run(args.pull, args.steps, args.port)))
        return
    runs = {"batched": [], "per-param": []}
    for repeat in range(args.repeats):
        for pull in runs:
            runs[pull].append(run(pull, args.steps, args.port + 2 * repeat + (pull == "batched")))
    print("| pulls | parameter tensors | time in pulls per step | step | forward | transport calls per step |")
    print("| --- | --- | --- | --- | --- | --- |")
    for pull, results in runs.items():
        step = statistics.median(max(r["step_ms"] for r in ranks) for ranks in results)
        forward = statistics.median(max(r["forward_ms"] for r in ranks) for ranks in results)
        pulled = statistics.median(max(r["pull_ms"] for r in ranks) for ranks in results)
        calls = ", ".join(f"{n} {c}" for n, c in results[0][0]["transport_calls_per_step"].items() if c)
        print(f"| {pull} | {results[0][0]['tensors']} | {pulled:.3f} ms | {step:.1f} ms | {forward:.1f} ms | {calls} |")


if __name__ == "__main__":
    main()
