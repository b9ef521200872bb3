"""The one numeric-argument check (ds_odc/arguments.py) every layer uses: the values a user's typo or a computed
figure produces (a bool, a string, NaN, infinity, a float where a count is wanted) are refused, the rest pass, and
each caller's words and error type are kept."""
import math

import pytest

from ds_odc.arguments import is_finite_number, is_whole_number, require_finite_number, require_whole_number
from ds_odc.balance.split_limits import SplitLimits
from ds_odc.errors import ODCConfigError, ODCError
from ds_odc.runtime.cross_node_plan import resolve_cross_node


@pytest.mark.parametrize("value,minimum,expected", [(1, 1, True), (0, 1, False), (0, 0, True), (True, 0, False),
                                                    (2.0, 1, False), ("2", 1, False), (None, 0, False)])
def test_a_whole_number_is_an_int_that_is_not_a_bool(value, minimum, expected):
    assert is_whole_number(value, minimum) is expected


@pytest.mark.parametrize("value,expected", [(0, True), (0.5, True), (3, True), (-0.1, False), (math.nan, False),
                                            (math.inf, False), (False, False), ("1", False), (None, False)])
def test_a_finite_number_is_neither_a_bool_nor_nan_nor_infinite(value, expected):
    assert is_finite_number(value, 0) is expected


def test_the_refusals_name_the_argument_and_keep_the_caller_s_error_type():
    with pytest.raises(ODCConfigError, match=r"^nodes must be an int >= 1, got True$"):
        require_whole_number("nodes", True, 1, ODCConfigError)
    with pytest.raises(ODCError, match=r"^budget must be a finite number >= 0, got nan$"):
        require_finite_number("budget", math.nan, 0)
    with pytest.raises(ODCError, match=r"SplitLimits: max_group must be an int >= 1, got 0"):
        SplitLimits(world_size=4, node_size=4, max_group=0)
    with pytest.raises(ODCConfigError, match="node_replica_budget_gb must be a finite number of GiB"):
        resolve_cross_node("budget", math.inf, [], nodes=2, ranks_per_node=2)
