"""The schema and the README's "Options" table (the one place options are documented) cover every
option of ODCConfig: description, default and allowed values."""
import json
import os
import re

from ds_odc.config import ActivationOffloadConfig, BalanceConfig, ODCConfig, QuadraticCost
from ds_odc.config_schema import generate

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _readme_options() -> dict:
    """option -> default cell of the README's Options table."""
    with open(os.path.join(ROOT, "README.md")) as readme:
        text = readme.read()
    section = text.split("\n## Options", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| `([a-z_.]+)` \| `?([^`|]*)`? \|", section, flags=re.M)
    return {name: default.strip() for name, default in rows}


def test_schema_gives_every_option_its_allowed_values():
    schema = generate()
    stage = schema["properties"]["zero_optimization"]["properties"]["stage"]
    assert {"const": "odc"} in stage["anyOf"] and "offload_param" in stage["description"]
    options = schema["$defs"]["ODCConfig"]
    assert options["additionalProperties"] is False
    assert set(options["properties"]) == set(ODCConfig.model_fields)
    for name, spec in options["properties"].items():
        kinds = spec.get("anyOf", [spec])  # an optional option: its value's spec or null
        assert all("enum" in k or "$ref" in k or k.get("type") in ("number", "integer", "string", "boolean", "null")
                   for k in kinds), name
    timeout = options["properties"]["timeout_s"]
    assert timeout["default"] is None and {"type": "null"} in timeout["anyOf"]
    assert timeout["anyOf"][0]["minimum"] == 0.1
    assert options["properties"]["accumulator_stripe_numel"]["minimum"] == 1024


def test_readme_documents_every_option_with_its_default():
    documented = _readme_options()
    for name, field in ODCConfig.model_fields.items():
        assert name in documented, f"README 'Options' table has no row for {name}"
        assert json.loads(documented[name]) == field.default, f"README default of {name}: {documented[name]}"
    for name, field in BalanceConfig.model_fields.items():
        row = f"balance.{name}"
        assert row in documented, f"README 'Options' table has no row for {row}"
        expected = "required" if field.is_required() else field.default
        assert (documented[row] if field.is_required() else json.loads(documented[row])) == expected, row
    for name, field in ActivationOffloadConfig.model_fields.items():
        row = f"activation_offload.{name}"
        assert row in documented, f"README 'Options' table has no row for {row}"
        expected = "required" if field.is_required() else field.default
        assert (documented[row] if field.is_required() else json.loads(documented[row])) == expected, row
    known = set(ODCConfig.model_fields) | {f"balance.{name}" for name in BalanceConfig.model_fields} | \
        {f"activation_offload.{name}" for name in ActivationOffloadConfig.model_fields}
    assert set(documented) <= known, set(documented) - known


def test_nested_blocks_are_in_the_schema_with_their_fields_documented():
    defs = generate()["$defs"]
    for model in (BalanceConfig, QuadraticCost, ActivationOffloadConfig):
        spec = defs[model.__name__]
        assert spec["additionalProperties"] is False and set(spec["properties"]) == set(model.model_fields)
        assert all(field.get("description") for field in spec["properties"].values()), model.__name__
    assert defs["BalanceConfig"]["required"] == ["token_cap"]
