"""A plain DeepSpeed ZeRO-3 training script, as users already have them: it never imports ds_odc.

Run under a launcher with the ds_config path as its argument; prints the engine it got and the losses.
Whether the "odc" stage works for it depends only on the config and the installed autoload hook.
"""
import json
import sys

import deepspeed
import torch


def main(config_path: str) -> None:
    with open(config_path) as file:
        config = json.load(file)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    rank = deepspeed.comm.get_rank()
    for step in range(2):
        gen = torch.Generator().manual_seed(10 * step + rank)
        x, y = torch.randn(4, 8, generator=gen), torch.randn(4, 4, generator=gen)
        loss = ((engine(x) - y) ** 2).mean()
        engine.backward(loss)
        engine.step()
        print(f"rank {rank} step {step} loss {loss.item():.6f}", flush=True)
    print(f"rank {rank} engine {type(engine).__name__} ds_odc imported {'ds_odc' in sys.modules}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
