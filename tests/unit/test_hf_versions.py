"""The transformers / accelerate glue that ds_odc patches is where it expects, in the releases it pins."""
import os
import re

import pytest

from ds_odc.integration import hf, hf_trainer
from ds_odc.integration.versions import TESTED_HF, untested_hf_release

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_setup_pins_exactly_the_releases_the_patches_were_verified_on():
    with open(os.path.join(ROOT, "setup.py")) as file:
        pins = dict(re.findall(r'"(transformers|accelerate)==([0-9.]+)"', file.read()))
    assert pins == TESTED_HF


@pytest.mark.parametrize("package", sorted(TESTED_HF))
def test_installed_release_is_the_tested_one(package):
    module = pytest.importorskip(package)
    assert untested_hf_release(package, module.__version__) is None, (
        f"{package} {module.__version__} installed: re-verify ds_odc/integration/hf*.py against it "
        "(tests/distributed/test_hf_trainer.py), then update TESTED_HF and the pins in setup.py")
    assert "tested with" in untested_hf_release(package, "0.0.1")


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
