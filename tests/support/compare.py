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


def same_bits(actual: dict, expected: dict) -> bool:
    """Whether two dicts of tensors by name are equal bit for bit (the same names required)."""
    assert actual.keys() == expected.keys(), (sorted(actual), sorted(expected))
    return all(torch.equal(actual[name], expected[name]) for name in expected)


def assert_same_run(expected: dict, actual: dict, label: str = "") -> None:
    """Two runs' records bit for bit: ``losses``, and per step ``grads`` (where both recorded the summed gradients
    each step reads) and ``params`` (full tensors by name). The gradients matter: an update far below a parameter's
    last bit leaves it unchanged, so parameters alone hide a sum that differs in its last bits."""
    assert actual["losses"] == expected["losses"], f"{label}: losses differ"
    assert ("grads" in actual) == ("grads" in expected), label
    for kind in ("grads", "params") if "grads" in expected else ("params",):
        assert len(actual[kind]) == len(expected[kind]) > 0, (label, kind)
        for step, (a, e) in enumerate(zip(actual[kind], expected[kind], strict=True)):
            assert a.keys() == e.keys(), (label, kind, step, sorted(a), sorted(e))
            differ = [name for name in e if not torch.equal(a[name], e[name])]
            assert not differ, f"{label}: {kind} differ at step {step}: {differ}"


#: A bf16 run's summed gradients lie within this many times ZeRO-3's own bf16-vs-fp32 gradient difference (about
#: 1e-2 relative to the largest element): measured at most 0.82x with fp32 accumulators and 1.5x with bf16 ones
#: over 10 steps (test_parity.py), at most 0.88x on two hosts (replicate, global, budget). A gradient off by a
#: factor of 2 lies about 1.0 away: 30x beyond it.
BF16_GRAD_SLACK = 3.0


def bf16_excess(runs: dict, zero3: dict, zero3_fp32: dict, key: str, slack: float) -> list:
    """Steps at which a bf16 run's ``key`` ("params" or "grads": full tensors by name, one dict per step) lies
    farther from ZeRO-3's bf16 run than ``slack`` times ZeRO-3's own bf16-vs-fp32 difference at that step: bf16 has
    no exact answer, and ZeRO-3's own rounding is the bar. Gradients as well as parameters: under Adam with
    clipping a gradient off by a constant factor moves parameters by far less than a bf16 rounding, while it moves
    the gradient by the factor itself. Returns ``(name, step, difference, bar)`` for each step beyond the bar."""
    beyond = []
    for step in range(len(zero3[key])):
        bar = slack * worst_rel_diff(zero3[key][step], zero3_fp32[key][step])
        assert bar > 0, (key, step)  # bf16 and fp32 runs differ at every step, or the bar says nothing
        for name, run in runs.items():
            difference = worst_rel_diff(run[key][step], zero3[key][step])
            if difference > bar:
                beyond.append((name, step, difference, bar))
    return beyond
