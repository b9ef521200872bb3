"""Every kind of bad "odc" config fails at ``deepspeed.initialize`` with a message naming the field
(and, for a value, what is allowed); a good one still builds an engine."""
from tests.support.harness import run_ranks
from tests.support.workloads import bad_configs, ds_config

# name -> (config, text the error must contain)
CASES = {
    "unknown key": (ds_config("odc", odc={"timeout": 3}), "zero_optimization.odc.timeout"),
    "enabled is not an option": (ds_config("odc", odc={"enabled": False}), "zero_optimization.odc.enabled"),
    "options not a dict": (ds_config("odc", odc=[1]), "zero_optimization.odc must be a dict"),
    "wrong type": (ds_config("odc", odc={"timeout_s": "fast"}), "zero_optimization.odc.timeout_s"),
    "number as string": (ds_config("odc", odc={"timeout_s": "5"}), "zero_optimization.odc.timeout_s"),
    "bool for a number": (ds_config("odc", odc={"timeout_s": True}), "zero_optimization.odc.timeout_s"),
    "fraction for an integer": (ds_config("odc", odc={"accumulator_stripe_numel": 2048.5}),
                                "zero_optimization.odc.accumulator_stripe_numel"),
    "below range": (ds_config("odc", odc={"timeout_s": 0}), "zero_optimization.odc.timeout_s"),
    "above range": (ds_config("odc", odc={"timeout_s": 1e9}), "less than or equal to 86400"),
    "stripe too small": (ds_config("odc", odc={"accumulator_stripe_numel": 10}), "greater than or equal to 1024"),
    "accumulator dtype": (ds_config("odc", odc={"accumulator_dtype": "fp16"}), "'fp32', 'fp64' or 'bf16'"),
    "bf16 accumulators under an fp32 model": (ds_config("odc", odc={"accumulator_dtype": "bf16"}),
                                              "accumulator_dtype='bf16' needs a bf16 model"),
    "normalisation rule": (ds_config("odc", odc={"loss_normalization": "sample"}), "'auto' or 'token'"),
    "missing shm_dir": (ds_config("odc", odc={"shm_dir": "/nonexistent/dir"}), "zero_optimization.odc.shm_dir"),
    "misspelt stage": (ds_config("odcc"), "zero_optimization.stage='odcc': allowed values are 0, 1, 2, 3 and \"odc\""),
    "odc options under stage 2": ({**ds_config(3), "zero_optimization": {"stage": 2, "odc": {"timeout_s": 3}}},
                                  "zero_optimization.odc is set but zero_optimization.stage=2"),
    "bad option in the marker form": ({**ds_config(3), "zero_optimization": {"stage": 3, "odc": {"timeout": 3}}},
                                      "zero_optimization.odc.timeout"),
    "parameter offload to nvme": (ds_config("odc", offload_param={"device": "nvme", "nvme_path": "/tmp"}),
                                  "zero_optimization.offload_param"),
    "optimizer offload to nvme": (ds_config("odc", offload_optimizer={"device": "nvme", "nvme_path": "/tmp"}),
                                  "zero_optimization.offload_optimizer"),
    "MiCS": (ds_config("odc", mics_shard_size=2), "zero_optimization.mics_shard_size"),
    "hpZ": (ds_config("odc", zero_hpz_partition_size=2), "zero_optimization.zero_hpz_partition_size"),
    "quantized weights": (ds_config("odc", zero_quantized_weights=True), "zero_optimization.zero_quantized_weights"),
    "fp16": ({**ds_config("odc"), "fp16": {"enabled": True}}, "fp16.enabled"),
    "tensor parallelism": ({**ds_config("odc"), "tensor_parallel": {"autotp_size": 2}}, "tensor_parallel.autotp_size"),
}
GOOD = {
    "defaults": ds_config("odc"),
    "every option": ds_config("odc", odc={"transport": "shm", "timeout_s": 30, "shm_dir": "/dev/shm",
                                          "accumulator_stripe_numel": 4096, "accumulator_dtype": "fp64",
                                          "loss_normalization": "auto"}),
    "offload device none": ds_config("odc", offload_param={"device": "none"}),
    "fp16 auto (HF fills it)": {**ds_config("odc"), "fp16": {"enabled": "auto"}},
    "bf16 accumulators under a bf16 model": ds_config("odc", bf16=True, odc={"accumulator_dtype": "bf16"}),
}


def test_each_bad_value_fails_at_initialize_naming_the_field():
    cases = [(name, cfg) for name, (cfg, _) in CASES.items()] + list(GOOD.items())
    messages = run_ranks(bad_configs, 1, cases)[0]
    for name, (_, expected) in CASES.items():
        assert messages[name] is not None, f"{name}: initialize accepted it"
        assert messages[name].startswith("ODCConfigError"), f"{name}: {messages[name]}"
        assert expected in messages[name], f"{name}: {messages[name]}"
    for name in GOOD:
        assert messages[name] is None, f"{name}: {messages[name]}"
