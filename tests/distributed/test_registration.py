"""``import ds_odc`` makes every way of passing a config to deepspeed.initialize understand "odc"."""
import json

import pytest

from tests.support.harness import RankHang, run_ranks
from tests.support.workloads import ds_config, engine_kinds, hang_on_rank

ODC = ("ODCEngine", 3, "ODCStage3Optimizer")


def test_initialize_builds_odc_engine_for_dict_path_args_and_config_params(tmp_path):
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(ds_config("odc")))
    kinds = run_ranks(engine_kinds, 2, str(path))[0]
    assert kinds["dict"] == kinds["path"] == kinds["args"] == kinds["config_params"] == ODC
    assert kinds["stage3"] == ("DeepSpeedEngine", 3, "DeepSpeedZeroOptimizer_Stage3")
    assert kinds["args_restored"] and kinds["file_untouched"]


def test_harness_names_the_hung_rank():
    with pytest.raises(RankHang, match=r"rank\(s\) \[1\] hung"):
        run_ranks(hang_on_rank, 2, 1, timeout=20)
