"""Host-side logic of the GPU transport, on any machine: transport selection and its errors, the
operator builder's status, the push kernel's work split, the GPU topology checks."""
import doctest
import os
import re
import subprocess
import sys

import pytest
import torch

import ds_odc.comm
import ds_odc.comm.gpu_topology
import ds_odc.comm.push_plan
import ds_odc.ops_builder
from ds_odc.comm import available_transports, create_transport, select_transport
from ds_odc.comm.gpu_topology import RankDevice, resolve_peer_devices
from ds_odc.comm.push_plan import element_visits, push_plan
from ds_odc.config import parse_options
from ds_odc.errors import ODCConfigError
from ds_odc.ops_builder import ATOMICS, CUDA_IPC, build_directory, load_op, op_status

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

FIELD = "zero_optimization.odc.transport"
no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the behaviour without CUDA")


@pytest.mark.parametrize("module", [ds_odc.comm, ds_odc.comm.gpu_topology, ds_odc.comm.push_plan])
def test_docstring_examples(module):
    failures, tried = doctest.testmod(module)
    assert tried > 0 and failures == 0


# -- selection ---------------------------------------------------------------------------------------
def test_config_accepts_cuda_ipc_and_names_the_field_for_unknown_transports():
    assert parse_options({"transport": "cuda_ipc"}).transport == "cuda_ipc"
    with pytest.raises(ODCConfigError, match=r"zero_optimization\.odc\.transport.*nvshmem"):
        parse_options({"transport": "nvshmem"})


def test_cpu_shards_get_shm_whatever_way_they_are_named():
    assert select_transport("auto", "cpu") == "shm"
    assert select_transport("shm", torch.device("cpu")) == "shm"


@pytest.mark.parametrize("name,device,expected", [
    ("cuda_ipc", "cpu", r"'cuda_ipc' serves cuda tensors, but the model's shards are on 'cpu'; use 'auto'"),
    ("shm", "cuda:0", r"'shm' serves cpu tensors, but the model's shards are on 'cuda:0'"),
    ("auto", "meta", r"'auto': no ODC transport serves 'meta' tensors"),
    ("nccl", "cpu", r"'nccl' is not a transport; allowed: 'auto', 'shm', 'cuda_ipc'"),
])
def test_impossible_combinations_fail_naming_the_field(name, device, expected):
    with pytest.raises(ODCConfigError, match=rf"{FIELD}={expected}"):
        select_transport(name, device)


@no_cuda
def test_cuda_ipc_without_cuda_fails_at_creation_with_the_reason():
    with pytest.raises(ODCConfigError, match=rf"{FIELD}='cuda_ipc' is not available here: .*is_available\(\) is False"):
        create_transport("auto", rank=0, world_size=2, timeout_s=5.0, device="cuda:0")
    usable, why = available_transports()["cuda_ipc"]
    assert not usable and "torch.cuda.is_available() is False" in why
    assert available_transports()["shm"] == (True, "")


def test_cuda_ipc_transport_refuses_a_cpu_device():
    from ds_odc.comm.cuda_ipc import CudaIpcTransport

    with pytest.raises(ValueError, match="needs a CUDA device, got cpu"):
        CudaIpcTransport(0, 2, 5.0, device="cpu")


# -- operator builder ----------------------------------------------------------------------------------
def test_op_status_shape():
    status = op_status()
    assert [s["name"] for s in status] == [ATOMICS.name, CUDA_IPC.name]
    for entry in status:
        assert set(entry) == {"name", "built", "buildable", "reason", "sources"}
        # from the checkout (an editable install): the repository's ops/csrc; an installed wheel's
        # own copy is checked by tests/distributed/test_wheel_install.py
        assert entry["sources"] == os.path.join(ROOT, "ops", "csrc")
        assert isinstance(entry["built"], bool) and isinstance(entry["buildable"], bool)
        assert entry["buildable"] == (entry["reason"] == "")


@no_cuda
def test_without_cuda_the_op_is_not_buildable_and_load_names_why(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    entry = next(s for s in op_status() if s["name"] == CUDA_IPC.name)
    assert not entry["built"] and not entry["buildable"]
    if torch.version.cuda is None:
        assert "CPU-only build" in entry["reason"]
    with pytest.raises(RuntimeError, match=f"{CUDA_IPC.name}.*cannot be built here: {re.escape(entry['reason'])}"):
        load_op(CUDA_IPC)
    assert list(tmp_path.iterdir()) == []  # nothing was compiled or even prepared


def test_build_directory_follows_sources_and_torch(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    directory = build_directory(CUDA_IPC)
    assert directory.parent == tmp_path / "ds_odc"
    assert directory.name.startswith(f"{CUDA_IPC.name}_{CUDA_IPC.fingerprint()}_py")
    assert len(CUDA_IPC.fingerprint()) == 12 and CUDA_IPC.fingerprint() == CUDA_IPC.fingerprint()


def test_importing_ds_odc_needs_no_compiler_and_builds_nothing(tmp_path):
    """A fresh interpreter without nvcc or CUDA_HOME on its path imports ds_odc and reports the ops."""
    env = {k: v for k, v in os.environ.items() if k not in ("CUDA_HOME", "CUDA_PATH")}
    env.update(PATH=os.path.dirname(sys.executable) + ":/usr/bin:/bin", TORCH_EXTENSIONS_DIR=str(tmp_path),
               DS_ACCELERATOR="cpu")
    code = ("import sys, ds_odc\n"
            "assert 'ds_odc.ops_builder' not in sys.modules and 'ds_odc.comm.cuda_ipc' not in sys.modules\n"
            "assert not any(m.startswith('ds_odc_cuda') for m in sys.modules)\n"
            "from ds_odc.ops_builder import op_status\n"
            "print(op_status())\n")
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "'name': 'ds_odc_cuda_ipc'" in done.stdout
    assert list(tmp_path.iterdir()) == []


# -- push work split -------------------------------------------------------------------------------------
@pytest.mark.parametrize("acc_size,src_size", [(4, 4), (4, 2), (8, 4), (8, 2)])
def test_push_plan_touches_every_element_exactly_once(acc_size, src_size):
    for numel in (0, 1, 3, 4, 5, 7, 8, 17, 64, 1001):
        for dst_misalign in range(0, 16, acc_size):
            for src_misalign in range(0, 16, src_size):
                for threads, max_blocks in ((32, 1), (32, 3), (256, 16)):
                    dst, src = 4096 + dst_misalign, 8192 + src_misalign
                    plan = push_plan(dst, src, numel, acc_size, src_size, threads=threads, max_blocks=max_blocks)
                    where = (numel, dst_misalign, src_misalign, threads, max_blocks, plan)
                    assert torch.equal(element_visits(plan), torch.ones(numel, dtype=torch.int64)), where
                    assert 0 <= plan.head < 4 and 0 <= plan.tail < 4 + plan.head, where
                    if plan.groups and acc_size == 4:
                        assert (dst + plan.head * acc_size) % 16 == 0, where  # vector reductions aligned
                    if plan.vector_loads:
                        assert (src + plan.head * src_size) % (4 * src_size) == 0, where
                    assert 1 <= plan.blocks <= max_blocks, where
                    # the kernel may launch fewer blocks than planned (one wave of the device): still once each
                    assert torch.equal(element_visits(plan, blocks=1), torch.ones(numel, dtype=torch.int64)), where


def test_push_plan_uses_vector_loads_when_both_sides_align_and_bounds_blocks():
    plan = push_plan(1 << 20, 1 << 21, 64 << 20, 4, 2)  # by default one block per tile: the device's wave bounds it
    assert plan.head == 0 and plan.tail == 0 and plan.vector_loads and plan.blocks == (16 << 20) // (4 * 256)
    assert push_plan(1 << 20, 1 << 21, 64 << 20, 4, 2, max_blocks=16).blocks == 16
    assert push_plan(1 << 20, (1 << 21) + 2, 1000, 4, 2).vector_loads is False


def test_the_plan_and_the_kernel_agree_on_groups_per_thread():
    """push_plan replays the kernel's tiles: its UNROLL must be the kernel's kUnroll."""
    source = (ds_odc.ops_builder.OPS_DIR / "csrc" / "odc_kernels.cu").read_text()
    assert int(re.search(r"constexpr int kUnroll = (\d+);", source).group(1)) == ds_odc.comm.push_plan.UNROLL


@pytest.mark.parametrize("args,message", [
    ((1002, 2000, 10, 4, 2), "element-aligned"),
    ((1000, 2001, 10, 4, 2), "element-aligned"),
    ((1000, 2000, 10, 2, 2), "accumulator element size"),
    ((1000, 2000, 10, 4, 8), "gradient element size"),
])
def test_push_plan_rejects_bad_input(args, message):
    with pytest.raises(ValueError, match=message):
        push_plan(*args)


# -- topology ---------------------------------------------------------------------------------------------
def _never_called(a, b):
    raise AssertionError("ranks on one GPU need no peer-access check")


def test_ranks_sharing_one_gpu_need_no_peer_access():
    ranks = [RankDevice("h", 1, "GPU-a"), RankDevice("h", 2, "GPU-a")]
    assert resolve_peer_devices(ranks, 1, ["GPU-a"], _never_called) == [0, 0]


@pytest.mark.parametrize("ranks,visible,p2p,message", [
    ([RankDevice("a", 1, "GPU-a"), RankDevice("b", 2, "GPU-a")], ["GPU-a"], None, r"one host, got hosts \['a', 'b'\]"),
    ([RankDevice("h", 1, "GPU-a"), RankDevice("h", 2, "GPU-b")], ["GPU-a"], None,
     r"rank 1's GPU GPU-b is not visible to rank 0.*CUDA_VISIBLE_DEVICES"),
    ([RankDevice("h", 1, "GPU-a"), RankDevice("h", 2, "GPU-b")], ["GPU-a", "GPU-b"], (False, False),
     r"GPUs 0 \(rank 0\) and 1 \(rank 1\) cannot access each other's memory"),
    ([RankDevice("h", 1, "GPU-a"), RankDevice("h", 2, "GPU-b")], ["GPU-a", "GPU-b"], (True, False),
     r"no native peer atomics.*NVLink"),
], ids=["two-hosts", "hidden-gpu", "no-p2p", "no-atomics"])
def test_unusable_topologies_are_refused_with_the_ranks_named(ranks, visible, p2p, message):
    with pytest.raises(ODCConfigError, match=message):
        resolve_peer_devices(ranks, 0, visible, lambda a, b: p2p)
