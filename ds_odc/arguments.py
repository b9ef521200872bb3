"""The one check of a numeric argument, for every layer: a whole number is an ``int`` that is not a ``bool`` (``True``
is an ``int`` to Python, never a count to a user), and a finite number is an ``int`` or ``float`` that is neither a
``bool``, NaN nor infinite. Each caller keeps its own words and error type; only the test is written once.

A leaf module: it imports nothing of ds_odc but :mod:`ds_odc.errors`, so ``comm/``, ``runtime/`` and ``balance/``
may all use it (tests/unit/test_layering.py)."""
from __future__ import annotations

import math
from typing import Type

from ds_odc.errors import ODCError


def is_whole_number(value, minimum: int) -> bool:
    """``value`` is an ``int`` (not a ``bool``) of at least ``minimum``."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= minimum


def is_finite_number(value, minimum: float) -> bool:
    """``value`` is an ``int`` or ``float`` (not a ``bool``), finite, of at least ``minimum`` (NaN is not)."""
    return (isinstance(value, (int, float)) and not isinstance(value, bool) and value >= minimum
            and not math.isinf(value))


def require_whole_number(name: str, value, minimum: int, error: Type[ODCError] = ODCError) -> None:
    """Raise ``error`` naming ``name`` unless :func:`is_whole_number`."""
    if not is_whole_number(value, minimum):
        raise error(f"{name} must be an int >= {minimum}, got {value!r}")


def require_finite_number(name: str, value, minimum: float, error: Type[ODCError] = ODCError) -> None:
    """Raise ``error`` naming ``name`` unless :func:`is_finite_number`."""
    if not is_finite_number(value, minimum):
        raise error(f"{name} must be a finite number >= {minimum:g}, got {value!r}")
