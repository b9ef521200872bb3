"""Comparison helpers: relative difference normalised by the reference's largest magnitude."""
import torch


def max_rel_diff(actual: torch.Tensor, expected: torch.Tensor) -> float:
    actual, expected = actual.double(), expected.double()
    scale = expected.abs().max().item()
    return (actual - expected).abs().max().item() / max(scale, 1e-12)


def worst_rel_diff(actual: dict, expected: dict) -> float:
    assert actual.keys() == expected.keys(), (sorted(actual), sorted(expected))
    return max(max_rel_diff(actual[k], expected[k]) for k in expected)


def movement_distance(actual: dict, expected: dict, initial: dict) -> float:
    """||actual - expected|| / ||expected - initial|| over every parameter: how far from the reference, in units
    of how far the reference moved (for bf16 runs, where an element-wise bar says nothing: Adam turns the rounding
    of a near-zero gradient into a full step either way)."""
    assert actual.keys() == expected.keys(), (sorted(actual), sorted(expected))
    off = sum(float((actual[k].double() - expected[k].double()).pow(2).sum()) for k in expected) ** 0.5
    moved = sum(float((expected[k].double() - initial[k].double()).pow(2).sum()) for k in expected) ** 0.5
    return off / moved


def assert_close_nested(actual, expected, rtol: float, atol: float, path: str = "") -> None:
    """``torch.testing.assert_close`` through dicts, lists and tuples, naming the path that differs."""
    if isinstance(expected, dict):
        assert isinstance(actual, dict) and actual.keys() == expected.keys(), f"{path}: keys {actual} vs {expected}"
        for key in expected:
            assert_close_nested(actual[key], expected[key], rtol, atol, f"{path}.{key}")
    elif isinstance(expected, (list, tuple)):
        assert isinstance(actual, (list, tuple)) and len(actual) == len(expected), f"{path}: {actual} vs {expected}"
        for i, (a, e) in enumerate(zip(actual, expected)):
            assert_close_nested(a, e, rtol, atol, f"{path}[{i}]")
    else:
        torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol, msg=lambda m: f"{path}: {m}")
