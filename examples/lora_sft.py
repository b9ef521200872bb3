"""LoRA fine-tuning with PEFT and the Hugging Face Trainer on the ODC stage: the base model frozen, adapters trained.

The data and the Trainer set-up are ``examples/hf_trainer_sft.py``'s. PEFT wraps the tiny Llama after it is built
(under ``zero.Init``, so the base is partitioned as in ZeRO-3); adapters on the attention and MLP projections are the
only trainable parameters. The frozen base is pulled like any parameter but never pushed: only the adapters'
gradients reach their owners. At the end rank 0 writes the adapters with PEFT's ``save_pretrained`` (gathered from
their owners: the Trainer's ``save_model`` does that under ZeRO-3 and the odc stage alike).

    DS_ACCELERATOR=cpu torchrun --nproc_per_node 2 examples/lora_sft.py --steps 40
    torchrun --nproc_per_node <GPUs> examples/lora_sft.py --steps 40
"""
import os
import sys

from peft import LoraConfig, get_peft_model
from transformers import LlamaForCausalLM

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from hf_trainer_sft import parse_args, tiny_llama_config, train, training_arguments  # noqa: E402

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def main():
    args = parse_args(__doc__.split("\n")[0], lr=3e-2)
    training_args = training_arguments(args)
    base = LlamaForCausalLM._from_config(tiny_llama_config())
    model = get_peft_model(base, LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=TARGETS,
                                            task_type="CAUSAL_LM"))
    trainable = sum(p.ds_numel if hasattr(p, "ds_numel") else p.numel() for p in model.parameters() if p.requires_grad)
    frozen = sum(p.ds_numel if hasattr(p, "ds_numel") else p.numel() for p in model.parameters() if not p.requires_grad)
    trainer = train(model, training_args, args)
    trainer.save_model()  # the adapters only (adapter_model.safetensors), gathered from their owners
    if trainer.is_world_process_zero():
        print(f"lora: {trainable} trainable parameters, {frozen} frozen | saved to {args.output_dir}", flush=True)


if __name__ == "__main__":
    main()
