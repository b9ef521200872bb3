"""A minimal ZeRO-3 training script with "stage": "odc", run by the launcher tests under
``deepspeed`` (hostfile or --num_gpus) and ``torchrun``: it reads its rank from the environment
the launcher sets, trains two steps and prints one line per rank."""
import os
import sys

import deepspeed
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from tests.support.workloads import ds_config, make_model, micro_batch, mse_mean  # noqa: E402


def main():
    torch.set_num_threads(1)
    deepspeed.init_distributed(dist_backend="gloo")
    engine, *_ = deepspeed.initialize(model=make_model(), config=ds_config("odc"))
    rank = engine.global_rank
    losses = []
    for step in range(2):
        x, y, _ = micro_batch(step, rank, 0)
        loss = mse_mean(engine(x), y)
        engine.backward(loss)
        engine.step()
        losses.append(round(loss.item(), 6))
    print(f"launched rank {rank}/{engine.world_size} local_rank {os.environ.get('LOCAL_RANK')} "
          f"engine {type(engine).__name__} losses {losses}", flush=True)
    engine.destroy()


if __name__ == "__main__":
    main()
