"""Train a small causal LM with the ODC stage, on long-tailed sequence lengths (CPU ranks or GPUs).

Each optimizer step takes a global minibatch of samples with LongAlign-like lengths (scaled down),
and the LB-Mini balancer gives every rank an equal *amount of compute*: ranks run different numbers
of micro-batches (packed samples under a token cap), and the loss is normalised per token over the
whole minibatch. Under ZeRO-3 different micro-batch counts would hang; under ODC ranks only meet at
the step. Each step prints the loss and every rank's utilisation (busy / wall, from ``ds_odc.metrics``).

    DS_ACCELERATOR=cpu torchrun --nproc_per_node 2 examples/train_causal_lm.py
    DS_ACCELERATOR=cpu deepspeed --num_gpus 2 examples/train_causal_lm.py
    torchrun --nproc_per_node <GPUs> examples/train_causal_lm.py        # one rank per GPU, cuda_ipc
    deepspeed --hostfile examples/hostfile examples/train_causal_lm.py \
        --deepspeed_config examples/ds_config_two_nodes_odc.json           # two nodes (examples/hostfile)

Batches are built on the CPU by the data loader and moved to ``engine.device`` in ``loss_sum``
(examples/packed_lm.py). ``--backend`` picks the process group's backend: gloo (the default: ODC's
collectives are a few at start-up, and gloo lets several ranks share one GPU) or nccl.

The only ODC-specific line in the config is ``"stage": "odc"``; the ODC-specific calls are the
balanced sampler and ``engine.backward(loss_sum, loss_tokens=n)`` for per-token normalisation.
"""
import argparse
import json
import os
import sys

import deepspeed
import torch
from deepspeed import comm as dist
from torch.utils.data import DataLoader

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import ds_odc  # noqa: E402,F401  registers the "odc" stage
from ds_odc.balance import BalancedBatchSampler, CostModel  # noqa: E402
from ds_odc.metrics import step_line  # noqa: E402

from packed_lm import PackedCausalLM, longalign_like_lengths, loss_sum, make_sample, pack  # noqa: E402

SCALE = 128  # LongAlign's 64K-token cap becomes 512 tokens: a step takes a fraction of a second on a CPU


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--deepspeed_config", default=os.path.join(os.path.dirname(__file__), "ds_config_odc.json"))
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--samples_per_rank", type=int, default=4)
    parser.add_argument("--policy", default="lb-mini", choices=["lb-mini", "lb-micro", "local-sort"])
    parser.add_argument("--backend", default="gloo", choices=["gloo", "nccl"])
    parser.add_argument("--local_rank", type=int, default=-1)
    args = parser.parse_args()

    deepspeed.init_distributed(dist_backend=args.backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    token_cap = 65_536 // SCALE
    lengths = longalign_like_lengths(args.steps * args.samples_per_rank * world, SCALE, seed=0)
    dataset = [make_sample(index, length) for index, length in enumerate(lengths)]
    sampler = BalancedBatchSampler(lengths, samples_per_rank=args.samples_per_rank, token_cap=token_cap,
                                   policy=args.policy, cost_model=CostModel.quadratic_linear(1.98, 2.61, token_cap),
                                   seed=0)
    loader = DataLoader(dataset, batch_sampler=sampler, collate_fn=pack)

    torch.manual_seed(0)
    with open(args.deepspeed_config) as config_file:
        config = json.load(config_file)
    engine, *_ = deepspeed.initialize(model=PackedCausalLM(max_len=token_cap), config=config)
    if rank == 0:
        across = getattr(engine.odc_runtime, "cross_node", None)  # what cross_node resolved to, on several nodes
        nodes = f", cross_node {across.requested}: {across.mode}" if across is not None else ""
        print(f"engine: {type(engine).__name__}, zero stage {engine.zero_optimization_stage()}, {world} ranks, "
              f"{args.policy} balancing, on {engine.device}{nodes}")

    progress = sampler.group_steps(loader)
    if rank == 0:
        from tqdm import tqdm
        progress = tqdm(progress, total=len(sampler.micro_batches_per_step()), desc="training", unit="step")
    for step, micro_batches in enumerate(progress):
        total, tokens = 0.0, 0
        for batch in micro_batches:  # a different number of micro-batches on each rank
            loss = loss_sum(engine, batch)
            engine.backward(loss, loss_tokens=len(batch[1]))
            total, tokens = total + loss.item(), tokens + len(batch[1])
        engine.step()
        gathered = [None] * world
        dist.all_gather_object(gathered, (total, tokens, engine.odc_metrics.last.without_events()))  # log line only
        if rank == 0:
            loss_per_token = sum(g[0] for g in gathered) / sum(g[1] for g in gathered)
            progress.set_postfix(loss=f"{loss_per_token:.3f}")
            utilisation = step_line([g[2] for g in gathered], with_step=False)
            progress.write(f"step {step:3d} | loss/token {loss_per_token:.4f} | {utilisation}")
    engine.destroy()


if __name__ == "__main__":
    main()
