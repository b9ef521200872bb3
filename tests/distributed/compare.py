"""Comparison helpers: relative difference normalised by the reference's largest magnitude."""
import torch


def max_rel_diff(actual: torch.Tensor, expected: torch.Tensor) -> float:
    actual, expected = actual.double(), expected.double()
    scale = expected.abs().max().item()
    return (actual - expected).abs().max().item() / max(scale, 1e-12)


def worst_rel_diff(actual: dict, expected: dict) -> float:
    assert actual.keys() == expected.keys(), (sorted(actual), sorted(expected))
    return max(max_rel_diff(actual[k], expected[k]) for k in expected)
