"""A mixture-of-experts model fine-tuned with the Hugging Face Trainer on the ODC stage.

The data and the Trainer set-up are ``examples/hf_trainer_sft.py``'s; the model is a tiny Qwen3-MoE (8 experts, 2 per
token, in every layer) with the router's load-balancing loss on (``output_router_logits``), which the model adds to
its loss, so the Trainer's backward carries it. Nothing marks the expert blocks as leaf modules: under the odc stage
each rank pulls what its own forward needs, so data-dependent routing needs no agreement between ranks.

    DS_ACCELERATOR=cpu torchrun --nproc_per_node 2 examples/moe_sft.py --steps 40
    torchrun --nproc_per_node <GPUs> examples/moe_sft.py --steps 40
"""
import os
import sys

from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from hf_trainer_sft import BOS, EOS, PAD, VOCAB, parse_args, train, training_arguments  # noqa: E402


def tiny_moe_config() -> Qwen3MoeConfig:
    return Qwen3MoeConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                          num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                          num_experts=8, num_experts_per_tok=2, decoder_sparse_step=1, output_router_logits=True,
                          router_aux_loss_coef=0.01, max_position_embeddings=64, pad_token_id=PAD, bos_token_id=BOS,
                          eos_token_id=EOS)


def main():
    args = parse_args(__doc__.split("\n")[0], lr=1e-2)
    training_args = training_arguments(args)
    model = Qwen3MoeForCausalLM._from_config(tiny_moe_config())
    experts = sum(1 for name, _ in model.named_parameters() if ".experts." in name)
    trainer = train(model, training_args, args)
    if trainer.is_world_process_zero():
        print(f"moe: {experts} expert tensors, router aux loss on", flush=True)


if __name__ == "__main__":
    main()
