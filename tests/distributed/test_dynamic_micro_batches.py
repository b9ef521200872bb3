"""examples/dynamic_micro_batches.py: an RL-style actor update whose ranks pack their own rollouts
under a token budget. On ODC each rank runs only its own micro-batches (no MAX all-reduce, no
padding); that equals the padded loop on ZeRO-3 and one process on all ranks' samples, every step.

The ranks call the example's own ``train`` (the loop the script runs); the script itself is run
under torchrun too."""
import os
import subprocess
import sys

import deepspeed
import torch

from tests.support.compare import worst_rel_diff
from tests.support.harness import free_port, run_ranks
from tests.support.workloads import clip_like_deepspeed, full_params

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "examples"))

import dynamic_micro_batches as example  # noqa: E402

from packed_lm import loss_sum, pack  # noqa: E402

STEPS = 3
ROLLOUTS = (2, 6)  # rank 0: two short rollouts; rank 1: six ~4x longer ones (dummies needed when padded)
MAX_TOKEN_LEN = 64
MODEL = {"dim": 32, "heads": 2, "layers": 2}
RUNS = (("odc", "unpadded"), (3, "padded"))
# SGD with momentum rather than the example's AdamW: Adam divides each gradient by its own magnitude, so
# it cannot see a wrong normaliser (a constant gradient scale), and it blows rounding noise up to a full
# step where the true gradient is zero (the attention key bias: softmax ignores it).
OPTIMIZER = {"type": "SGD", "params": {"lr": 0.05, "momentum": 0.9}}
# fp32: the three runs sum the same per-token losses in different orders and groupings (ODC's owners
# add pushes in arrival order, the padded loop splits micro-batches, the reference packs one row). The
# LayerNorm biases start at zero, so after a step they are -lr x their gradient, whose rounding is
# cancellation-heavy: test_parity.py's FP32_ARRIVAL_ORDER_TOL. Measured worst: 9e-7 (a normaliser off by
# any factor, or a micro-batch lost or counted twice, is >= 1e-2).
TOL = 4e-6


def config(stage):
    """The example's ds_config, stage replaced, with :data:`OPTIMIZER`."""
    return {**example.load_config(stage), "optimizer": OPTIMIZER, "zero_allow_untested_optimizer": True}


def both_loops():
    """In each rank: the unpadded loop on ODC, then the padded loop on ZeRO-3; full weights after
    every step and the example's per-step records."""
    runs = {}
    for stage, mode in RUNS:
        engine, *_ = deepspeed.initialize(model=example.build_model(MAX_TOKEN_LEN, **MODEL),
                                          config=config(stage))
        params = []
        records = example.train(engine, STEPS, mode, ROLLOUTS, MAX_TOKEN_LEN,
                                on_step=lambda step, record, params=params, engine=engine:
                                params.append(full_params(engine)))
        runs[mode] = {"engine": type(engine).__name__, "records": records, "params": params}
        engine.destroy()
    return runs


def single_process(world=2):
    """One process, plain PyTorch: each step's rollouts of every rank in one packed row, the summed
    loss divided by the global token count, DeepSpeed's clipping, the same SGD."""
    model = example.build_model(MAX_TOKEN_LEN, **MODEL)
    optimizer = torch.optim.SGD(model.parameters(), **OPTIMIZER["params"])
    params = []
    for step in range(STEPS):
        samples = [s for rank in range(world)
                   for s in example.make_rollouts(step, rank, world, ROLLOUTS[rank], MAX_TOKEN_LEN)]
        batch = pack(samples)
        optimizer.zero_grad()
        (loss_sum(model, batch) / len(batch[1])).backward()
        clip_like_deepspeed(model, config("odc")["gradient_clipping"])
        optimizer.step()
        params.append({n: p.detach().clone() for n, p in model.named_parameters()})
    return params


def test_unpadded_odc_equals_padded_zero3_and_one_process():
    ranks = run_ranks(both_loops, 2)
    unpadded = [r["unpadded"] for r in ranks]
    padded = [r["padded"] for r in ranks]
    assert [r["engine"] for r in unpadded] == ["ODCEngine"] * 2
    assert [r["engine"] for r in padded] == ["DeepSpeedEngine"] * 2
    for step in range(STEPS):
        ran = [r["records"][step]["ran"] for r in unpadded]
        assert ran[0] < ran[1], f"step {step}: ranks were meant to run different micro-batch counts, ran {ran}"
        assert ran == [r["records"][step]["packed"] for r in unpadded]  # exactly what each rank packed
        assert all(r["records"][step]["dummies"] == 0 for r in unpadded)
        padded_ran = [r["records"][step]["ran"] for r in padded]
        assert padded_ran == [max(ran)] * 2, f"step {step}: padded loop ran {padded_ran}, packed {ran}"
        assert [r["records"][step]["tokens"] for r in padded] == [r["records"][step]["tokens"] for r in unpadded]
    assert any(r["records"][s]["dummies"] for r in padded for s in range(STEPS)), "no dummy micro-batch ran"

    reference = single_process()
    for step in range(STEPS):
        for rank in range(2):
            against_zero3 = worst_rel_diff(unpadded[rank]["params"][step], padded[rank]["params"][step])
            against_single = worst_rel_diff(unpadded[rank]["params"][step], reference[step])
            assert against_zero3 <= TOL, f"step {step}, rank {rank}: ODC vs padded ZeRO-3 {against_zero3:.2e}"
            assert against_single <= TOL, f"step {step}, rank {rank}: ODC vs one process {against_single:.2e}"
    moved = worst_rel_diff(reference[-1], example.build_model(MAX_TOKEN_LEN, **MODEL).state_dict())
    assert moved > 1e-3, "the weights did not move"


def test_example_script_runs_under_torchrun():
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
           os.path.join(ROOT, "examples", "dynamic_micro_batches.py"), "--steps", "2", "--rollouts_per_rank", "8",
           "--max_token_len", "128"]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240, cwd=ROOT)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-4000:]
    assert "engine: ODCEngine, zero stage 3, 2 ranks, unpadded" in output
    steps = [line for line in output.splitlines() if line.startswith("step ")]
    assert len(steps) == 2, output[-2000:]
    for line in steps:
        counts = [int(n) for n in line.split("micro-batches ")[1].split(" |")[0].split("/")]
        assert counts[0] != counts[1], line
        assert 0 < float(line.split("loss/token ")[1].split(" |")[0]) < 10, line
