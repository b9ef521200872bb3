"""The check that no parameter reached ZeRO-3's gradient bucket twice in one backward (``_odc_push_bucket``): it
must name the parameters, as ZeRO-3's own assertion does. Counted with ``list.count`` it compared tensors with
``==`` and raised PyTorch's "Boolean value of Tensor ... is ambiguous" instead (found when a retried micro-batch
went down this path). The bucket is a stand-in here: the check reads only its parameters' ``ds_id``."""
from types import SimpleNamespace

import pytest
import torch

from ds_odc.integration.zero3_optimizer import ODCStage3Optimizer


def test_a_parameter_in_the_bucket_twice_is_named_before_anything_is_pushed():
    first, second = torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.ones(3))
    first.ds_id, second.ds_id = 7, 8
    bucket = SimpleNamespace(params=[first, second, first], elements=9)
    optimizer = SimpleNamespace(ipg_buckets={torch.float32: bucket})
    with pytest.raises(RuntimeError, match=r"^parameters \[7\] reached ZeRO-3's gradient bucket twice"):
        ODCStage3Optimizer._odc_push_bucket(optimizer, torch.float32)
    assert len(bucket.params) == 3  # nothing pushed, nothing cleared
