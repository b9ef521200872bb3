import doctest

import pytest

import ds_odc.balance
import ds_odc.balance.cost
import ds_odc.balance.packing
import ds_odc.balance.partition
import ds_odc.balance.slots
import ds_odc.balance.split
import ds_odc.balance.split_cost
import ds_odc.balance.split_plan
import ds_odc.comm.cross_node
import ds_odc.comm.failure
import ds_odc.comm.replica_link
import ds_odc.comm.shm
import ds_odc.comm.topology
import ds_odc.config
import ds_odc.runtime.layout
import ds_odc.runtime.replica_layout
import ds_odc.runtime.same_model
import ds_odc.runtime.split_lockstep
import ds_odc_import_hooks


@pytest.mark.parametrize("module", [ds_odc.config, ds_odc.runtime.layout, ds_odc.runtime.same_model, ds_odc.balance,
                                    ds_odc.balance.cost, ds_odc.balance.packing, ds_odc.balance.partition,
                                    ds_odc.comm.shm, ds_odc.balance.slots, ds_odc.comm.topology,
                                    ds_odc.comm.cross_node, ds_odc.comm.failure, ds_odc_import_hooks,
                                    ds_odc.balance.split, ds_odc.balance.split_cost, ds_odc.balance.split_plan,
                                    ds_odc.runtime.split_lockstep, ds_odc.comm.replica_link,
                                    ds_odc.runtime.replica_layout])
def test_docstring_examples(module):
    failures, tried = doctest.testmod(module)
    assert tried > 0 and failures == 0
