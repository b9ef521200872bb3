"""Benchmark cells run where their cell says: a CUDA cell gets DeepSpeed's CUDA accelerator
and torch's threads, a CPU cell the CPU accelerator and one thread. Spawned processes, no GPU needed (the
rank only reads its environment)."""
import os

from benchmarks import cells


def seen(rank, cell):
    import torch

    return {"accelerator": os.environ["DS_ACCELERATOR"], "threads": torch.get_num_threads()}


def test_a_cuda_cell_is_not_forced_onto_one_cpu_thread(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "2")  # torch's default in the ranks, unless the cell forces one
    assert cells.accelerator_of({"device": "cuda"}) == cells.accelerator_of({"device": "cuda:0"}) == "cuda"
    assert cells.accelerator_of({"device": "cpu"}) == cells.accelerator_of({}) == "cpu"
    cpu = cells.run_cell(seen, 1, {"device": "cpu"}, "cpu cell", timeout_s=120)[0]
    assert cpu == {"accelerator": "cpu", "threads": 1}
    cuda = cells.run_cell(seen, 1, {"device": "cuda"}, "cuda cell", timeout_s=120)[0]
    assert cuda == {"accelerator": "cuda", "threads": 2}
