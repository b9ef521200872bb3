import doctest

import pytest

import ds_odc.config
import ds_odc.runtime.layout


@pytest.mark.parametrize("module", [ds_odc.config, ds_odc.runtime.layout])
def test_docstring_examples(module):
    failures, tried = doctest.testmod(module)
    assert tried > 0 and failures == 0
