"""Trains three steps, prints its loss, destroys its engine and ends with a collective (the sum of the
losses), without ``destroy_process_group()``. Without ds_odc's exit hook this aborted at interpreter exit with
"terminate called without an active exception" in about 3 runs of 4 (ds_odc/integration/clean_exit.py).

``python -m torch.distributed.run --nproc_per_node 2 tests/support/exit_script.py [odc|3]``"""
import sys

import deepspeed
import torch
import torch.distributed as dist


def main():
    stage = sys.argv[1] if len(sys.argv) > 1 else "odc"
    # The main thread keeps the GIL until it blocks, as a busy main thread on a loaded machine does:
    # this widens the window in which a gloo worker still owes a decref when finalization starts.
    sys.setswitchinterval(1.0)
    torch.set_num_threads(1)
    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    config = {"train_micro_batch_size_per_gpu": 2,
              "zero_optimization": {"stage": int(stage) if stage.isdigit() else stage},
              "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}}}
    engine, *_ = deepspeed.initialize(model=model, config=config)
    for step in range(3):
        torch.manual_seed(100 * step + engine.global_rank)
        loss = engine(torch.randn(2, 8)).sum()
        engine.backward(loss)
        engine.step()
    from ds_odc.integration import clean_exit
    print(f"exit_script rank {engine.global_rank} engine {type(engine).__name__} "
          f"exit hook {'on' if clean_exit.installed() else 'off'} loss {loss.item():.6f}", flush=True)
    total = loss.detach().clone()
    engine.destroy()  # the engine is released; the process group is not
    del engine, model
    dist.all_reduce(total)  # the last statement: a collective, then the interpreter exits

if __name__ == "__main__":
    main()
