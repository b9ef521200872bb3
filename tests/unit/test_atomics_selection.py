"""Which memory ordering a process gets when the ``ds_odc_atomics`` operator cannot be built (docs/failures.md,
"Memory ordering"): x86-64 falls back to plain accesses (correct under TSO) and says so; every other architecture
refuses, naming the operator, why it could not be built and what to install. No build machine has these
architectures at hand, so the selection is driven here: the machine's name is what ``platform.machine()`` reports,
and the operator's load fails as :func:`ds_odc.ops_builder.load_op` fails where ninja is missing. In-process, no
ranks."""
import platform

import pytest
import torch

from ds_odc import ops_builder
from ds_odc.comm import ordering
from ds_odc.errors import ODCConfigError

#: What load_op raises where the operator cannot be built (its own wording, see ops_builder.load_op).
WHY = "ninja is not installed (pip install ninja)"
#: Weakly ordered CPUs (as platform.machine() names them), and 32-bit x86: TSO, but its plain 64-bit stores are two
#: 32-bit stores, so a peer could read half of a new sequence number.
REFUSING = ["aarch64", "arm64", "ppc64le", "riscv64", "s390x", "i686"]
FALLING_BACK = ["x86_64", "AMD64"]


@pytest.fixture
def without_the_operator(monkeypatch):
    """A fresh selection (nothing chosen yet in this process) where the operator's load fails, and where the
    report's probe finds it unbuildable for the same reason."""
    def load_op(spec, **unused):
        raise RuntimeError(f"ds_odc operator {spec.name!r} cannot be built here: {WHY}")

    monkeypatch.setattr(ordering, "_ordering", None)
    monkeypatch.setattr(ops_builder, "load_op", load_op)
    monkeypatch.setattr(ops_builder, "op_status", lambda: [{"name": ops_builder.ATOMICS.name, "built": False,
                                                            "buildable": False, "reason": WHY, "sources": ""}])


def on(monkeypatch, machine: str) -> None:
    monkeypatch.setattr(platform, "machine", lambda: machine)


@pytest.mark.parametrize("machine", REFUSING)
def test_other_architectures_refuse_to_start_naming_the_operator_and_the_fix(without_the_operator, monkeypatch,
                                                                            machine):
    """Plain accesses there would let a peer see a new sequence number before the payload it publishes (or a torn
    one): a wrong result without an error, so the windows must not be allocated at all."""
    on(monkeypatch, machine)
    with pytest.raises(ODCConfigError) as refused:
        ordering.memory_ordering()
    message = str(refused.value)
    assert ops_builder.ATOMICS.name in message and machine in message, message
    assert WHY in message, message  # why it could not be built
    assert "C++ compiler" in message and "ninja" in message and "TORCH_EXTENSIONS_DIR" in message, message
    assert ordering._ordering is None  # nothing chosen: a later call (after the fix) tries the operator again
    usable, description = ordering.describe()  # python -m ds_odc report
    assert not usable and machine in description and WHY in description, description


@pytest.mark.parametrize("machine", FALLING_BACK)
def test_x86_64_falls_back_to_plain_accesses_and_says_why(without_the_operator, monkeypatch, machine):
    """TSO already orders plain stores as releases and plain loads as acquires: x86-64 runs without a compiler."""
    on(monkeypatch, machine)
    chosen = ordering.memory_ordering()
    assert isinstance(chosen, ordering.TSOOrdering), chosen
    assert "x86-64 TSO" in chosen.name and WHY in chosen.name, chosen.name
    assert ordering.memory_ordering() is chosen  # chosen once per process
    words = torch.zeros(4, dtype=torch.int64)
    chosen.store_release(words, 2, 2**40 + 7)
    assert chosen.load_acquire(words, 2) == 2**40 + 7 and words.tolist() == [0, 0, 2**40 + 7, 0]
    usable, description = ordering.describe()
    assert usable and description == chosen.name, description
