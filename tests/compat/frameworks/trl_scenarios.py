"""TRL's trainers as a user runs them, on 2 CPU ranks: SFT, DPO (reference model through TRL's
``prepare_deepspeed``), GRPO (generation through TRL's own ``unwrap_model_for_generation``, a KL term so a
frozen reference engine exists too), DPO with ds_odc's balance block and parameters released after use
(ranks call the frozen reference model different numbers of times: the case that used to hang), and GRPO
with long-tailed completion lengths and parameters released after use (``grpo_long``: TRL's default
``ds3_gather_for_generation=True``; ``grpo_long_nogather``: ``False``, per-layer gathers or pulls at every
decoding step), where ranks end their rollouts at different tokens (``long_tail.py``).

    torchrun --nproc_per_node 2 trl_scenarios.py {sft,dpo,grpo,dpo_balance,grpo_long,grpo_long_nogather} \
        MODEL_DIR OUTPUT_DIR

The route comes from ``DS_ODC_COMPAT_ROUTE`` ("odc" or "3"); nothing else differs between the two runs.
Rank 0 writes the logged loss and gradient norm of every step (``logging_steps=1``).
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import long_tail  # noqa: E402

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


def grpo_long(model_dir, output_dir, config, gather=True):
    """GRPO whose completions end at long-tailed lengths (4 to 64 tokens, ``long_tail.py``), timed and counted
    per rank. ``gather``: TRL's ``ds3_gather_for_generation``."""
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    def reward_letters(completions, **_):
        return [float(text.count("a")) / (1 + len(text)) for text in completions]

    args = GRPOConfig(**shared_args(output_dir, config), num_generations=2, max_completion_length=long_tail.LONGEST,
                      beta=0.04, temperature=1.0, ds3_gather_for_generation=gather)
    start_deepspeed_comm()
    tokenizer = common.build_tokenizer()
    tokenizer.padding_side = "left"
    trainer = GRPOTrainer(model=model_dir, reward_funcs=reward_letters, args=args, processing_class=tokenizer,
                          train_dataset=Dataset.from_dict({"prompt": common.prompts()}))
    rollouts = long_tail.Rollouts()
    rollouts.instrument(trainer.model, tokenizer.pad_token_id, tokenizer.eos_token_id)
    trainer._generate = rollouts.timed(trainer._generate)
    trainer.add_callback(rollouts.callback())
    trainer.odc_compat_rollouts = rollouts
    return trainer


def grpo_long_nogather(model_dir, output_dir, config):
    return grpo_long(model_dir, output_dir, config, gather=False)


SCENARIOS = {"sft": sft, "dpo": dpo, "grpo": grpo, "dpo_balance": dpo_balance, "grpo_long": grpo_long,
             "grpo_long_nogather": grpo_long_nogather}


def config_for(scenario: str) -> dict:
    base = common.HF_BASE
    options = None
    if scenario in ("dpo_balance", "grpo_long", "grpo_long_nogather"):
        base = {**base, "zero_optimization": {**base["zero_optimization"], **common.RELEASED}}
    if scenario == "dpo_balance":
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
    extra, problems = {}, []
    rollouts = getattr(trainer, "odc_compat_rollouts", None)
    if rollouts is not None:  # the long-tailed GRPO scenarios: per-rank rollouts, held to the forwards expected
        ranks = long_tail.gather(rollouts)
        extra["rollouts"] = ranks
        problems = long_tail.check_forwards(ranks, synced=common.route() == "3")
        for rank, steps in enumerate(ranks):
            if common.rank() == 0:
                print(f"rank {rank} longest completion per step {[s['longest'] for s in steps]}, forwards inside "
                      f"generate {[s['forwards'] for s in steps]}", flush=True)
    common.write_result(common.trainer_losses(history), grad_norms=common.trainer_losses(history, "grad_norm"),
                        micro_batches=common.trainer_losses(history, "odc_micro_batches"), **extra)
    if rollouts is not None and problems:
        raise SystemExit("; ".join(problems))


if __name__ == "__main__":
    main()
