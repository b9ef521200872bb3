"""JSON Schema of the ds_config additions, generated from :class:`ds_odc.config.ODCConfig`.

    python -m ds_odc.config_schema            # rewrite config_schemas/odc.schema.json
    python -m ds_odc.config_schema --check    # exit 1 if the file is out of date
"""
import ast
import inspect
import json
import os
import sys

from ds_odc.config import _UNSUPPORTED_ZERO_OPTIONS, ActivationOffloadConfig, BalanceConfig, ODCConfig, QuadraticCost

#: Option blocks inside ODCConfig, documented the same way.
NESTED_MODELS = (BalanceConfig, QuadraticCost, ActivationOffloadConfig)

#: Settings outside ``zero_optimization`` that the odc stage rejects (see ``config._check_compatibility``).
_UNSUPPORTED_ELSEWHERE = ("fp16.enabled=true (use bf16)", "tensor_parallel.autotp_size > 1",
                          "sequence_parallel_size > 1 (use ALST's mpu for Ulysses sequence parallelism)")

SCHEMA_PATH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "config_schemas",
                           "odc.schema.json")


def _field_docs(model) -> dict:
    """The string under each field of a pydantic model (Megatron-style per-field docs)."""
    tree = ast.parse(inspect.getsource(model))
    body = tree.body[0].body
    docs = {}
    for node, following in zip(body, body[1:]):
        if isinstance(node, ast.AnnAssign) and isinstance(following, ast.Expr) and \
                isinstance(getattr(following, "value", None), ast.Constant):
            docs[node.target.id] = " ".join(following.value.value.split())
    return docs


def _documented(model, schema: dict) -> dict:
    for name, doc in _field_docs(model).items():
        schema["properties"][name]["description"] = doc
    return schema


def _incompatible() -> str:
    zero = sorted({f"zero_optimization.{key}" for key, _, _ in _UNSUPPORTED_ZERO_OPTIONS})
    return ", ".join(zero + list(_UNSUPPORTED_ELSEWHERE))


def generate() -> dict:
    options = ODCConfig.model_json_schema()
    nested = options.pop("$defs", {})  # the option blocks (balance, its cost model) sit beside ODCConfig
    _documented(ODCConfig, options)
    for model in NESTED_MODELS:
        nested[model.__name__] = _documented(model, nested[model.__name__])
        nested[model.__name__]["description"] = " ".join((model.__doc__ or "").split())
    options["description"] = "Options of the odc stage, under zero_optimization.odc."
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "title": "ds_odc additions to the DeepSpeed config",
        "type": "object",
        "properties": {
            "zero_optimization": {
                "type": "object",
                "properties": {
                    "stage": {
                        "description": 'ZeRO stage. ds_odc adds the value "odc": ZeRO-3 partitioning with '
                                       "one-sided pulls and pushes and a single synchronisation per step. "
                                       'Rejected at deepspeed.initialize together with "odc" (naming the field): '
                                       f"{_incompatible()}.",
                        "anyOf": [{"enum": [0, 1, 2, 3]}, {"const": "odc"}],
                    },
                    "odc": {"$ref": "#/$defs/ODCConfig"},
                },
            },
            "odc": {
                "description": 'Written by ds_odc, not by users: the canonical form of an "odc" config is '
                               '"stage": 3 plus this top-level block (the options that differ from their defaults).',
                "$ref": "#/$defs/ODCConfig",
            },
        },
        "$defs": {"ODCConfig": options, **nested},
    }


def main(argv) -> int:
    text = json.dumps(generate(), indent=2, sort_keys=True) + "\n"
    if "--check" in argv:
        with open(SCHEMA_PATH) as schema_file:
            return 0 if schema_file.read() == text else 1
    with open(SCHEMA_PATH, "w") as schema_file:
        schema_file.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
