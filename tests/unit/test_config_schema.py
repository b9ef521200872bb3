import json

from ds_odc.config_schema import OPTIONS_PATH, SCHEMA_PATH, generate, options_markdown


def test_committed_schema_matches_the_pydantic_models():
    with open(SCHEMA_PATH) as schema_file:
        committed = json.load(schema_file)
    assert committed == generate(), "config_schemas/odc.schema.json is stale: run python -m ds_odc.config_schema"


def test_committed_options_page_matches_the_pydantic_models():
    with open(OPTIONS_PATH) as page:
        assert page.read() == options_markdown(), "docs/options.md is stale: run make schema"


def test_every_option_is_documented_with_its_default():
    options = generate()["$defs"]["ODCConfig"]["properties"]
    for name, spec in options.items():
        assert spec.get("description"), f"option {name} has no description"
        assert "default" in spec, f"option {name} has no default"
