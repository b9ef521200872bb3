"""TRL's trainers as a user runs them, on 2 CPU ranks: SFT, DPO (reference model through TRL's
``prepare_deepspeed``), GRPO (generation through TRL's own ``unwrap_model_for_generation``, a KL term so a
frozen reference engine exists too) and DPO with ds_odc's balance block and parameters released after use
(ranks call the frozen reference model different numbers of times: the case that used to hang).

    torchrun --nproc_per_node 2 trl_scenarios.py {sft,dpo,grpo,dpo_balance} MODEL_DIR OUTPUT_DIR

The route comes from ``DS_ODC_COMPAT_ROUTE`` ("odc" or "3"); nothing else differs between the two runs.
Rank 0 writes the logged loss and gradient norm of every step (``logging_steps=1``).
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402

STEPS = int(os.environ.get("DS_ODC_COMPAT_STEPS", "4"))


def shared_args(output_dir: str, config: dict) -> dict:
    return dict(output_dir=output_dir, deepspeed=config, use_cpu=True, max_steps=STEPS, learning_rate=1e-3,
                logging_steps=1, save_strategy="no", report_to="none", seed=0, data_seed=0, bf16=False,
                dataloader_num_workers=0, lr_scheduler_type="constant", per_device_train_batch_size=2,
                gradient_accumulation_steps=2)


def start_deepspeed_comm() -> None:
    """CPU ranks: accelerate starts torch.distributed but not deepspeed.comm; zero.Init needs the latter
    (docs/frameworks.md, Hugging Face Trainer). Called after the TrainingArguments, before any model is built."""
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")


def sft(model_dir, output_dir, config):
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    args = SFTConfig(**shared_args(output_dir, config), max_length=64)
    start_deepspeed_comm()
    return SFTTrainer(model=model_dir, args=args, processing_class=common.build_tokenizer(),
                      train_dataset=Dataset.from_dict({"text": common.sft_texts()}))


def dpo(model_dir, output_dir, config, **extra):
    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer

    rows = common.preference_rows()
    args = DPOConfig(**{**shared_args(output_dir, config), **extra}, max_length=64, beta=0.1)
    start_deepspeed_comm()
    return DPOTrainer(model=model_dir, args=args, processing_class=common.build_tokenizer(),
                      train_dataset=Dataset.from_dict({key: [row[key] for row in rows] for key in rows[0]}))


def dpo_balance(model_dir, output_dir, config):
    """One pair per micro-batch on both routes (``per_device_train_batch_size=1``; on ODC a token cap no
    pair fits twice under), so the mean over micro-batches is the mean over pairs on both: the same update.
    On ODC LB-Mini gives the ranks different numbers of pairs (micro-batches) per step."""
    return dpo(model_dir, output_dir, config, per_device_train_batch_size=1, gradient_accumulation_steps=4)


def grpo(model_dir, output_dir, config):
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    def reward_letters(completions, **_):
        """More 'a's is better: a reward that differs between completions, so advantages are not zero."""
        return [float(text.count("a")) / (1 + len(text)) for text in completions]

    args = GRPOConfig(**shared_args(output_dir, config), num_generations=2, max_completion_length=8,
                      beta=0.04, temperature=1.0)
    start_deepspeed_comm()
    tokenizer = common.build_tokenizer()
    tokenizer.padding_side = "left"
    return GRPOTrainer(model=model_dir, reward_funcs=reward_letters, args=args, processing_class=tokenizer,
                       train_dataset=Dataset.from_dict({"prompt": common.prompts()}))


SCENARIOS = {"sft": sft, "dpo": dpo, "grpo": grpo, "dpo_balance": dpo_balance}


def config_for(scenario: str) -> dict:
    base = common.HF_BASE
    options = None
    if scenario == "dpo_balance":
        base = {**base, "zero_optimization": {**base["zero_optimization"], **common.RELEASED}}
        # no two pairs fit under the cap (see dpo_balance); the length is taken from the tokenised prompt
        cap = max(len(row["prompt"].encode()) for row in common.preference_rows())  # bytes = tokens
        # an attention-like cost (length squared): with these prompts (no length twice another) a cost in
        # tokens balances best at equal counts, a quadratic one gives the ranks different numbers of pairs
        options = {"balance": {"policy": "lb-mini", "token_cap": cap, "cost_model": {"a": 1.0, "b": 0.0},
                               "padding": "padded", "length_key": BALANCE_LENGTH_KEY}}
    return common.ds_config(common.route(), base, options if common.route() != "3" else None)


BALANCE_LENGTH_KEY = os.environ.get("DS_ODC_COMPAT_LENGTH_KEY", "prompt_ids")


def main():
    scenario, model_dir, output_dir = sys.argv[1:4]
    trainer = SCENARIOS[scenario](model_dir, output_dir, config_for(scenario))
    trainer.train()
    history = trainer.state.log_history
    common.write_result(common.trainer_losses(history), grad_norms=common.trainer_losses(history, "grad_norm"),
                        micro_batches=common.trainer_losses(history, "odc_micro_batches"))


if __name__ == "__main__":
    main()
