"""A training loop shaped like OpenRLHF's actor update, switched to ODC only by ``DS_ODC_STAGE3=odc``.

OpenRLHF itself cannot run on CPU (``torch.cuda.set_device``, ``init_device_mesh("cuda")``, flash-attn,
ray), so this script does what its DeepSpeed strategy does, with nothing ds_odc-specific in it:

- the ds_config is built in code from an integer stage (``get_train_ds_config(stage=3)``, and an eval
  config without optimizer for the frozen reference model), and the script branches on ``stage == 3``
  itself (``HfDeepSpeedConfig`` so ``from_pretrained`` runs under ``zero.Init``);
- dynamic batches: each rank packs its own rollouts into micro-batches under a token budget, so ranks have
  different counts (rank 1's rollouts are longer); GAS is 1 in the config, each micro-batch's loss is
  scaled by the caller by its share of the rank's tokens, ``backward()`` per micro-batch, one ``step()``;
  the frozen reference model is called once per micro-batch (a KL term), so its call counts differ too.

Route "env" (``DS_ODC_STAGE3=odc`` set by the runner) runs each rank's own micro-batches. Route "3" is
the loop OpenRLHF runs on ZeRO-3 today: all-reduce the MAX micro-batch count and pad with dummy
micro-batches whose loss is multiplied by zero (ZeRO-3's gathers are collectives, so ranks must make the
same number of forward calls, on the policy and on the reference). Both compute the same update, so
their losses must agree step by step; that compares ODC with exactly what a user switching would leave.
(The comparison with one process on all rollouts is ``tests/distributed/test_config_routes.py`` and
``test_dynamic_micro_batches.py``.)

    torchrun --nproc_per_node 2 openrlhf_loop.py MODEL_DIR OUTPUT_DIR
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import deepspeed  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import common  # noqa: E402

STEPS = int(os.environ.get("DS_ODC_COMPAT_STEPS", "4"))
TOKEN_BUDGET, KL_COEF = 64, 0.1
# SGD, not OpenRLHF's Adam: Adam's update barely changes when the gradient is scaled by a constant, so it
# hid this loop getting a third of ZeRO-3's gradient on ODC (fixed; docs/normalisation.md).
OPTIMIZER = {"type": "SGD", "params": {"lr": 0.1}}


def get_train_ds_config(stage: int) -> dict:
    """OpenRLHF's builder, in miniature: an int stage, GAS 1, its own keys, parameters released after use."""
    return {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
            "steps_per_print": 10_000, "bf16": {"enabled": False},
            "optimizer": OPTIMIZER, "zero_allow_untested_optimizer": True,
            "zero_optimization": {"stage": stage, "reduce_bucket_size": 10_000, **common.RELEASED}}


def get_eval_ds_config(stage: int) -> dict:
    return {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "bf16": {"enabled": False},
            "zero_optimization": {"stage": stage, **common.RELEASED}}


def rollouts(step: int, rank: int, tokenizer) -> list:
    """This rank's rollouts (token ids): rank 1's are about three times longer, so it packs more batches."""
    words = (2, 5) if rank == 0 else (7, 14)
    return [torch.tensor(tokenizer(common.sentence(step * 31 + rank * 7 + i, words[0] + i % words[1]))["input_ids"])
            for i in range(6)]


def pack(samples: list) -> list:
    """First fit under the token budget, in order (OpenRLHF's dynamic batch, per rank, no communication)."""
    batches, current = [], []
    for sample in samples:
        if current and sum(len(s) for s in current) + len(sample) > TOKEN_BUDGET:
            batches.append(current)
            current = []
        current.append(sample)
    return batches + ([current] if current else [])


def token_logps(model, samples: list):
    """Per-token log-probabilities of each sample's next tokens, right-padded; and the mask of real ones."""
    longest = max(len(s) for s in samples)
    ids = torch.zeros(len(samples), longest, dtype=torch.long)
    mask = torch.zeros(len(samples), longest, dtype=torch.long)
    for i, sample in enumerate(samples):
        ids[i, :len(sample)], mask[i, :len(sample)] = sample, 1
    logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1].float()
    logps = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    return logps, mask[:, 1:].float()


def micro_batch_loss(actor, reference, samples: list):
    """Summed negative log-likelihood plus a squared-log-ratio KL term against the frozen reference."""
    logps, mask = token_logps(actor, samples)
    with torch.no_grad():
        ref_logps, _ = token_logps(reference, samples)
    return (-(logps * mask).sum() + KL_COEF * (((logps - ref_logps) ** 2) * mask).sum() / 2)


def main():
    from transformers import AutoModelForCausalLM
    from transformers.integrations import HfDeepSpeedConfig

    model_dir = sys.argv[1]
    padded = common.route() == "3"
    deepspeed.init_distributed(dist_backend="gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    stage = 3  # OpenRLHF: --zero_stage 3 (type=int)
    train_config, eval_config = get_train_ds_config(stage), get_eval_ds_config(stage)
    hf_config = HfDeepSpeedConfig(train_config) if stage == 3 else None  # noqa: F841 - zero.Init while alive
    torch.manual_seed(0)
    actor = AutoModelForCausalLM.from_pretrained(model_dir)
    reference = AutoModelForCausalLM.from_pretrained(model_dir)
    actor, *_ = deepspeed.initialize(model=actor, config=train_config)
    reference, *_ = deepspeed.initialize(model=reference, config=eval_config)
    reference.eval()
    tokenizer = common.build_tokenizer()
    losses, counts_log, norms = [], [], []
    for step in range(STEPS):
        samples = rollouts(step, rank, tokenizer)
        batches = pack(samples)
        tokens = sum(len(s) - 1 for s in samples)
        counts = torch.tensor([len(batches)])
        if padded:  # OpenRLHF's replay buffer: MAX micro-batch count over the data-parallel ranks
            dist.all_reduce(counts, op=dist.ReduceOp.MAX)
        step_loss = 0.0
        for index in range(int(counts)):
            real = index < len(batches)
            loss = micro_batch_loss(actor, reference, batches[index] if real else batches[0][:1]) / tokens
            actor.backward(loss if real else loss * 0.0)
            step_loss += float(loss) if real else 0.0
        actor.step()
        norms.append(float(actor.get_global_grad_norm()))
        status = torch.tensor([step_loss, float(len(batches))])
        gathered = [torch.zeros_like(status) for _ in range(world)]
        dist.all_gather(gathered, status)  # OpenRLHF's strategy.all_reduce of the status, for logging
        losses.append(sum(float(g[0]) for g in gathered) / world)
        counts_log.append("/".join(str(int(g[1])) for g in gathered))
    common.write_result(losses, grad_norms=norms, micro_batches=counts_log, padded=padded)
    actor.destroy()
    reference.destroy()


if __name__ == "__main__":
    main()
