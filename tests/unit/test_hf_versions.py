"""The transformers / accelerate glue that ds_odc patches is where it expects, in the releases it declares."""
import os
import re

import pytest
import tomllib

from ds_odc.integration import hf, hf_trainer
from ds_odc.integration.versions import DEEPSPEED_RANGE, TESTED_HF, untested_hf_release

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _metadata() -> dict:
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as file:
        return tomllib.load(file)["project"]


def _requirement(lines: list, package: str) -> str:
    (found,) = [line for line in lines if re.match(rf"{package}\b", line)]
    return found


def test_package_metadata_declares_the_ranges_ds_odc_checks():
    """pip must not put ds_odc beside a release the code refuses (DeepSpeed) or was not verified on (HF)."""
    project = _metadata()
    low, high = DEEPSPEED_RANGE
    assert _requirement(project["dependencies"], "deepspeed") == f"deepspeed>={low},<={high}"
    hf_extra = project["optional-dependencies"]["hf"]
    for package, (oldest, newest) in TESTED_HF.items():
        major, minor = newest.split(".")
        assert _requirement(hf_extra, package) == f"{package}>={oldest},<{major}.{int(minor) + 1}"


def test_the_development_environment_pins_the_newest_tested_releases():
    test_extra = " ".join(_metadata()["optional-dependencies"]["test"])
    pins = dict(re.findall(r"(transformers|accelerate)==([0-9.]+)", test_extra))
    assert {package: ".".join(version.split(".")[:2]) for package, version in pins.items()} == \
        {package: newest for package, (_, newest) in TESTED_HF.items()}


@pytest.mark.parametrize("package", sorted(TESTED_HF))
def test_installed_release_is_a_tested_one(package):
    module = pytest.importorskip(package)
    assert untested_hf_release(package, module.__version__) is None, (
        f"{package} {module.__version__} installed: re-verify ds_odc/integration/hf*.py against it "
        "(tests/compat/run_version_matrix.py), then update TESTED_HF and the ranges in pyproject.toml")


@pytest.mark.parametrize("package, version, warns", [
    ("transformers", "4.57.0", False), ("transformers", "4.57.6", False), ("transformers", "5.6.0", False),
    ("transformers", "5.23.0", False), ("transformers", "5.23.1", False), ("transformers", "4.56.2", True),
    ("transformers", "5.24.0", True), ("transformers", "5.24.0.dev0", True), ("accelerate", "1.11.0", False),
    ("accelerate", "1.15.0", False), ("accelerate", "1.10.1", True), ("accelerate", "1.16.0", True),
])
def test_a_release_outside_the_tested_range_gets_a_warning_naming_the_range(package, version, warns):
    warning = untested_hf_release(package, version)
    assert (warning is not None) is warns
    if warns:
        assert f"tested with {package} {TESTED_HF[package][0]}.x to {TESTED_HF[package][1]}.x, found {version}" \
            in warning


def test_patches_are_in_place_once_the_libraries_are_imported():
    """accelerate's config reader at once; the Trainer hook once a config has asked for the odc stage."""
    pytest.importorskip("transformers")
    import accelerate.utils.deepspeed as acc_ds
    import transformers.integrations.deepspeed as tf_deepspeed
    import transformers.trainer as tf_trainer

    assert hf.is_patched()
    assert acc_ds.HfDeepSpeedConfig.set_stage_and_offload.__code__.co_filename == hf.__file__
    acc_ds.HfDeepSpeedConfig({"zero_optimization": {"stage": "odc"}})
    assert hf_trainer.is_patched()
    assert tf_trainer.Trainer.__init__.__code__.co_filename == hf_trainer.__file__
    assert tf_trainer.deepspeed_init is tf_deepspeed.deepspeed_init, "no module-level patch of the Trainer's module"


def test_hf_config_objects_see_an_odc_config_as_zero3():
    pytest.importorskip("transformers")
    from accelerate.utils.deepspeed import HfDeepSpeedConfig

    config = {"zero_optimization": {"stage": "odc", "odc": {"timeout_s": 9}}, "train_batch_size": "auto"}
    hf_config = HfDeepSpeedConfig(config)
    assert hf_config.is_zero3() and not hf_config.is_offload()
    assert hf_config.config["zero_optimization"]["stage"] == 3 and hf_config.config["odc"] == {"timeout_s": 9.0}
    assert config["zero_optimization"]["stage"] == "odc", "the caller's own dict is not modified"
    assert "auto" not in str(hf_config.config["odc"]), "accelerate would try to fill an 'auto' option"


def test_the_balance_block_is_refused_by_name_on_a_transformers_without_its_trainer_methods(monkeypatch):
    """transformers 4.57 to 5.2 have no Trainer._run_epoch / _track_num_input_tokens (surface_table.
    TRAINER_RUN_EPOCH): the odc stage works there, the balance block is refused, naming the release it needs."""
    from ds_odc.config import BalanceConfig
    from ds_odc.errors import ODCConfigError
    from ds_odc.integration import hf_balance, surface

    real = surface.installed_version
    monkeypatch.setattr(surface, "installed_version", lambda package: "4.57.1" if package == "transformers"
                        else real(package))
    with pytest.raises(ODCConfigError, match=r"balance .*needs transformers>=5\.3\.0 .*found transformers 4\.57\.1"):
        hf_balance.bind_balance(object(), BalanceConfig(token_cap=8), release="transformers 4.57.1")
