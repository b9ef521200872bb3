"""What of axolotl can run on CPU: accelerate configured only by the environment variables axolotl exports.

axolotl 0.21 itself needs Python >= 3.12 and CUDA-only packages (bitsandbytes, xformers, triton). What it
does with DeepSpeed is read the stage from the user's JSON and export it for accelerate:
``ACCELERATE_USE_DEEPSPEED=true``, ``ACCELERATE_DEEPSPEED_ZERO_STAGE=<stage>`` (accelerate calls ``int()``
on it), and ``ACCELERATE_DEEPSPEED_ZERO3_INIT=true`` only when the stage is exactly 3. The runner sets
those (route "env": ``ACCELERATE_DEEPSPEED_ZERO_STAGE=odc``; baseline: ``3``); this script is a plain
accelerate training loop that builds no DeepSpeed config of its own (accelerate's plugin builds it from
the environment), on a tiny Llama and the same SFT texts as the TRL scenario.

    torchrun --nproc_per_node 2 accelerate_env.py MODEL_DIR OUTPUT_DIR
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

import common  # noqa: E402

STEPS, GAS, MICRO = int(os.environ.get("DS_ODC_COMPAT_STEPS", "4")), 2, 2


def collate(tokenizer):
    """Right-pad a micro-batch of texts; labels masked on padding."""
    def collate_texts(texts):
        enc = tokenizer(texts, padding=True, return_tensors="pt")
        return {**enc, "labels": enc["input_ids"].masked_fill(enc["attention_mask"] == 0, -100)}
    return collate_texts


def main():
    from accelerate import Accelerator, PartialState
    from transformers import AutoModelForCausalLM

    model_dir = sys.argv[1]
    os.environ.setdefault("ACCELERATE_GRADIENT_ACCUMULATION_STEPS", str(GAS))
    # CPU ranks: the process group first, as the HF Trainer does with use_cpu (PartialState(cpu=True)); then
    # accelerate builds its DeepSpeed plugin from ACCELERATE_USE_DEEPSPEED / _ZERO_STAGE alone.
    PartialState(cpu=True)
    accelerator = Accelerator(gradient_accumulation_steps=GAS)
    plugin = accelerator.state.deepspeed_plugin
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    loader = torch.utils.data.DataLoader(common.sft_texts(), batch_size=MICRO, shuffle=False,
                                         collate_fn=collate(common.build_tokenizer()))
    engine, optimizer, loader = accelerator.prepare(
        model, torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0), loader)
    data = iter(loader)  # accelerate shards it over the ranks and fills the ds_config's batch sizes from it
    losses = []
    for _ in range(STEPS):
        step_loss = torch.zeros(())
        for _ in range(GAS):
            with accelerator.accumulate(engine):
                loss = engine(**next(data)).loss
                accelerator.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
            step_loss += loss.detach() / GAS
        losses.append(float(accelerator.reduce(step_loss, reduction="mean")))
    common.write_result(losses, plugin_stage=plugin.zero_stage)
    engine.destroy()


if __name__ == "__main__":
    main()
