"""What the ranks of test_two_hosts_global.py run for ``cross_node: "budget"`` (2 nodes x 2 ranks; whole layers
replicated per node, the rest global), inside two_host_workloads.py's ``cases`` job."""
from __future__ import annotations

import deepspeed
import torch.distributed as tdist

from tests.support.global_workloads import _runtime, record_calls, remote_elements
from tests.support.workloads import ds_config, make_model, micro_batch, mse_mean

#: 400 bytes per rank beyond global sharding: on the default test model (hidden 7, 2 blocks) with fp32 windows
#: and accumulators ((N-1)/W · 8 bytes per trainable element, 4 per frozen one), every unit but ``out.weight``
#: fits (364 of 406 bytes), the frozen layer included; with fp64 accumulators (12 per trainable element) ``inp``
#: and ``blocks.0`` do (294 of 581). Some layers, never all, either way.
BUDGET_BYTES = 400
BUDGET = {"cross_node": "budget", "node_replica_budget_gb": BUDGET_BYTES / 2 ** 30}


def shape() -> dict:
    """One budget engine (fp32, every parameter pulled on demand): what it chose and why, what it allocated, the
    bytes it read from and pushed to the other node in one micro-batch after the open round (against the layout:
    only non-replicated parameters' remote shards), and what it refuses by name."""
    cfg = ds_config("odc", stage3_param_persistence_threshold=0, odc=BUDGET)
    engine, *_ = deepspeed.initialize(model=make_model(layers=2), config=cfg)
    runtime = _runtime(engine)
    pulled, pushed = record_calls(runtime)
    rank = tdist.get_rank()
    remote = runtime.remote
    for step in range(2):
        if step == 1:
            before = (remote.bytes_read, remote.bytes_pushed)
            pulled.clear()
            pushed.clear()
        x, y, _ = micro_batch(step, rank, 0)
        engine.backward(mse_mean(engine(x), y))
        engine.step()
    element = engine.optimizer.lp_param_buffer.element_size()
    replicated = runtime.layout.replicated

    def crossing(keys):
        return sum(remote_elements(runtime, key) for key in keys if key not in replicated) * element

    transport = runtime.transport
    window, accumulator = transport.local_param_window(), transport.local_grad_accumulator()
    names = {p.ds_id: name for name, p in engine.module.named_parameters()}
    result = {
        "mode": runtime.cross_node.mode, "reason": runtime.cross_node.reason,
        "replicated_layers": runtime.cross_node.replicated_layers,
        "replicated_params": sorted(names[key] for key in replicated),
        "bytes_read": remote.bytes_read - before[0], "bytes_pushed": remote.bytes_pushed - before[1],
        "expected_read": crossing(pulled), "expected_pushed": crossing(pushed),
        "pulled_replicated": len([k for k in pulled if k in replicated]),
        "pulled_global": len([k for k in pulled if k not in replicated]),
        "window_bytes": window.numel() * window.element_size(),
        "accumulator_bytes": accumulator.numel() * accumulator.element_size(),
        "params": {name: (p.ds_numel, p.requires_grad) for name, p in engine.module.named_parameters()},
        "world": tdist.get_world_size(),
    }
    try:
        engine.offload_states()
        result["offload_states"] = None
    except Exception as err:  # noqa: BLE001 - the error is the result
        result["offload_states"] = (type(err).__name__, str(err))
    engine.destroy()
    try:  # refused at initialize, before any window exists
        deepspeed.initialize(model=make_model(), config=ds_config("odc", odc=BUDGET, offload_param={"device": "cpu"}))
        result["offload_param"] = None
    except Exception as err:  # noqa: BLE001 - the error is the result
        result["offload_param"] = (type(err).__name__, str(err))
    return result


def bits(counts, steps=3) -> dict:
    """Deterministic sums under the budget (some layers summed by the link, the rest at their owners)."""
    from tests.support.workloads import train_uneven

    run = train_uneven("odc", "unmanaged", counts, steps=steps, odc={"deterministic": True, **BUDGET},
                       record_grads=True)
    return {"params": run["params"], "grads": run["grads"]}
