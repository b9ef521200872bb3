"""JSON Schema of the ds_config additions, generated from :class:`ds_odc.config.ODCConfig`.

    python -m ds_odc.config_schema            # rewrite config_schemas/odc.schema.json
    python -m ds_odc.config_schema --check    # exit 1 if the file is out of date
"""
import ast
import inspect
import json
import os
import sys

from ds_odc.config import ODCConfig

SCHEMA_PATH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "config_schemas",
                           "odc.schema.json")


def _field_docs() -> dict:
    """The string under each field of ODCConfig (Megatron-style per-field docs)."""
    tree = ast.parse(inspect.getsource(ODCConfig))
    body = tree.body[0].body
    docs = {}
    for node, following in zip(body, body[1:]):
        if isinstance(node, ast.AnnAssign) and isinstance(following, ast.Expr) and \
                isinstance(getattr(following, "value", None), ast.Constant):
            docs[node.target.id] = " ".join(following.value.value.split())
    return docs


def generate() -> dict:
    options = ODCConfig.model_json_schema()
    for name, doc in _field_docs().items():
        options["properties"][name]["description"] = doc
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
                                       "one-sided pulls and pushes and a single synchronisation per step.",
                        "anyOf": [{"enum": [0, 1, 2, 3]}, {"const": "odc"}],
                    },
                    "odc": {"$ref": "#/$defs/ODCConfig"},
                },
            },
        },
        "$defs": {"ODCConfig": options},
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
