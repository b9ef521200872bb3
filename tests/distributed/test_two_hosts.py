"""Multi-node jobs, tested as two real hosts on one machine (see netns.py).

Each "node" is a network namespace of its own, joined to the other by a veth pair (addresses of
netns.SUBNET); every process run on a node also has its own UTS namespace (hostname ``node<i>``)
and its own mount namespace with a fresh tmpfs on /dev/shm, so nothing can pass by reaching the
other node's shared memory. Jobs are launched as users launch multi-node jobs: ``torchrun
--nnodes 2 --node_rank i --master_addr <node 0>`` and ``deepspeed --hostfile ... --no_ssh
--node_rank i`` on each node. One namespace pair serves the whole module; it is deleted at the end,
also when a test fails. Skipped, with the reason, only where namespaces cannot be created (not
root, no iproute2/util-linux, no CAP_SYS_ADMIN).
"""
import itertools
import json
import os
import re
import subprocess
import sys
import time

import pytest
import torch

from tests.support.checkpoint_workloads import (
    RESHARD_TOLERANCE,
    load_and_continue,
    merged_losses,
    to_universal,
    train_and_save,
)
from tests.support.compare import BF16_GRAD_SLACK, assert_same_run, bf16_excess, max_rel_diff, worst_rel_diff
from tests.support.harness import run_ranks
from tests.support.netns import available, two_hosts
from tests.support.two_host_workloads import MASKED, UNEVEN
from tests.support.workloads import reference_training

SCRIPT = os.path.join("tests", "support", "two_host_workloads.py")
BIN = os.path.dirname(sys.executable)
TRAIN_TIMEOUT_S = 120  # a job that has not ended by then is killed and the test fails
_ports = itertools.count(29411)  # ports of node 0's namespace: nothing else listens there

_ok, _reason = available()
pytestmark = pytest.mark.skipif(not _ok, reason=f"cannot create two hosts (network/mount/UTS namespaces): {_reason}")


def _our_namespaces(pair_names):
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=10).stdout
    return [name for name in pair_names if name in listed]


@pytest.fixture(scope="module")
def hosts():
    with two_hosts() as pair:
        yield pair
    names = [host.netns for host in pair.hosts]
    assert not _our_namespaces(names), f"namespaces left behind: {names}"


def _launch(hosts, launcher, stages, out_dir, timeout=TRAIN_TIMEOUT_S):
    """Launch the training script on both nodes, as users do, training each of ``stages`` in turn in the same job;
    returns (results, {stage: per-rank json files}), the hello files under each stage."""
    out_dir.mkdir()
    port = str(next(_ports))
    script = [SCRIPT, "train", ",".join(str(stage) for stage in stages), str(out_dir)]
    if launcher == "torchrun":
        argvs = [[os.path.join(BIN, "torchrun"), "--nnodes", "2", "--nproc_per_node", "2", "--node_rank", str(i),
                  "--master_addr", hosts.master_addr, "--master_port", port, *script] for i in range(2)]
    else:
        hostfile = out_dir / "hostfile"
        hostfile.write_text("".join(f"{host.hostname} slots=2\n" for host in hosts.hosts))
        argvs = [[os.path.join(BIN, "deepspeed"), "--hostfile", str(hostfile), "--no_ssh", "--node_rank", str(i),
                  "--master_addr", hosts.hosts[0].hostname, "--master_port", port, *script] for i in range(2)]
    results = hosts.run_on_both(argvs, timeout=timeout)
    hello = {path.stem: json.loads(path.read_text()) for path in out_dir.glob("*.json")}
    files = {}
    for stage in stages:
        files[str(stage)] = dict(hello)
        for path in (out_dir / str(stage)).glob("*.json") if (out_dir / str(stage)).is_dir() else ():
            files[str(stage)][path.stem] = json.loads(path.read_text())
    return results, files


def _logs(results):
    return "\n".join(result.tail() for result in results)


def _check_training(results, files, engine="DeepSpeedEngine"):
    logs = _logs(results)
    for result in results:
        assert not result.timed_out and result.returncode == 0, logs
    ranks = [files.get(f"rank{r}") for r in range(4)]
    assert all(ranks), f"missing rank results: {sorted(files)}\n{logs}"
    for r, rank in enumerate(ranks):
        assert rank["world"] == 4 and rank["env_world_size"] == "4" and rank["rank_sum"] == 6.0, rank
        assert rank["host"] == f"node{r // 2}" and rank["local_rank"] == str(r % 2), rank
        assert rank["shm"] == [], rank  # each node's own, fresh /dev/shm
        assert rank["engine"] == engine, rank
    for key in ("mean_losses", "eval_losses"):  # all-reduced loss; loss of the same batch under each rank's weights
        assert all(rank[key] == pytest.approx(ranks[0][key], rel=1e-6) for rank in ranks), [r[key] for r in ranks]
    assert len({tuple(rank["losses"]) for rank in ranks}) == 4  # every rank trained on its own data
    return ranks


def test_each_host_has_its_own_hostname_and_dev_shm(hosts, tmp_path):
    procs = hosts.start_on_both([[sys.executable, SCRIPT, "isolation", str(tmp_path)]] * 2)
    listed = [tmp_path / f"listed_node{i}.json" for i in range(2)]
    end = time.monotonic() + 30
    while (not all(path.exists() for path in listed) and time.monotonic() < end
           and all(proc.poll() is None for proc in procs)):
        time.sleep(0.05)
    # both hosts hold a file in their /dev/shm now: the root namespace sees neither
    root_shm = set(os.listdir("/dev/shm"))
    root_dev = os.stat("/dev/shm").st_dev
    (tmp_path / "release").write_text("")
    results = hosts.wait(procs, timeout=30)
    logs = _logs(results)
    assert all(path.exists() for path in listed), logs
    reports = [json.loads(path.read_text()) for path in listed]
    for result in results:
        assert result.returncode == 0, logs
    for i, report in enumerate(reports):
        assert report["host"] == f"node{i}", report
        assert report["before"] == [], report  # a fresh, empty tmpfs
        assert report["after"] == [report["mine"]], report  # its own file only, not the other host's
        assert report["mine"] not in root_shm, report
        assert report["shm_dev"] != root_dev, report
        assert report["hosts"] == {h.hostname: h.addr for h in hosts.hosts}, report
    assert reports[0]["shm_dev"] != reports[1]["shm_dev"]


@pytest.fixture(scope="module")
def launches(hosts, tmp_path_factory):
    """The training script under each launcher, made once for the module, ZeRO-3 then the odc stage in the same
    job (a launch on both hosts costs far more than a few steps): the launcher tests check ZeRO-3's runs, and the
    odc test compares its losses with them whichever tests are selected."""
    return {launcher: _launch(hosts, launcher, (3, "odc"), tmp_path_factory.mktemp(f"train_{launcher}") / "out")
            for launcher in ("torchrun", "deepspeed")}


def _stage(launch, stage):
    results, files = launch
    return results, files[str(stage)]


def test_torchrun_across_two_hosts_trains_zero3(launches):
    _check_training(*_stage(launches["torchrun"], 3))


def test_deepspeed_launcher_no_ssh_across_two_hosts_trains_zero3(launches):
    ranks = _check_training(*_stage(launches["deepspeed"], 3))
    torchrun = _check_training(*_stage(launches["torchrun"], 3))  # the same job, whichever launcher started it
    assert ranks[0]["mean_losses"] == pytest.approx(torchrun[0]["mean_losses"], rel=1e-6)


def test_odc_trains_across_two_hosts_with_both_launchers_as_zero3_does(launches):
    """The same script with ``"stage": "odc"``: every rank runs an ODCEngine, the 4 ranks agree, and
    the losses are ZeRO-3's (its run under the same launcher, same data and config)."""
    for launcher in ("torchrun", "deepspeed"):
        zero3 = _check_training(*_stage(launches[launcher], 3))
        ranks = _check_training(*_stage(launches[launcher], "odc"), engine="ODCEngine")
        assert all(rank["shm_after"] == [] for rank in ranks), [rank["shm_after"] for rank in ranks]
        assert ranks[0]["mean_losses"] == pytest.approx(zero3[0]["mean_losses"], rel=1e-6), launcher


# -- the odc stage on 2 nodes x 2 ranks: what single-node tests check, between two real hosts -----------
PARITY_CASES = ("adam_gas3", "sgd_gas1", "bf16_adam_gas1")
UNEVEN_CASES = ("uneven_unmanaged", "uneven_managed", "uneven_token")
FP32_TOL = 1e-6  # the single-node parity bars (test_parity.py)
FP32_ARRIVAL_ORDER_TOL = 4e-6


@pytest.fixture(scope="module")
def cases(hosts, tmp_path_factory):
    """One torchrun job on both hosts runs every case in turn (one launch: start-up is most of a case's
    time). Its checkpoint cases: save on 2x2, and load what 2 ranks of one host saved (run here first,
    then converted to the universal format)."""
    out_dir = tmp_path_factory.mktemp("cases")
    one_host = str(tmp_path_factory.mktemp("ckpt_1x2"))
    two_hosts_dir = str(tmp_path_factory.mktemp("ckpt_2x2"))
    saved_on_one_host = run_ranks(train_and_save, 2, one_host)
    names = ",".join(PARITY_CASES + UNEVEN_CASES + ("collectives", "memory", "offload_states", "deterministic",
                                                    f"ckpt_save:{two_hosts_dir}",
                                                    f"ckpt_load:{one_host}:{to_universal(one_host, 'saved')}"))
    port = str(next(_ports))
    argvs = [[os.path.join(BIN, "torchrun"), "--nnodes", "2", "--nproc_per_node", "2", "--node_rank", str(i),
              "--master_addr", hosts.master_addr, "--master_port", port, SCRIPT, "cases", names, str(out_dir)]
             for i in range(2)]
    results = hosts.run_on_both(argvs, timeout=240)
    logs = _logs(results)
    for result in results:
        assert not result.timed_out and result.returncode == 0, logs
    loaded = {name.split(":")[0]: [torch.load(out_dir / f"{name.split(':')[0]}_rank{r}.pt", weights_only=False)
                                   for r in range(4)] for name in names.split(",")}
    loaded["ckpt_save_1x2"] = saved_on_one_host
    loaded["ckpt_load_1x2"] = run_ranks(load_and_continue, 2, two_hosts_dir, to_universal(two_hosts_dir, "saved"))
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    loaded["ckpt_2x2_zero_to_fp32"] = get_fp32_state_dict_from_zero_checkpoint(two_hosts_dir, tag="saved")
    return loaded


@pytest.mark.parametrize("case", PARITY_CASES[:2])
def test_odc_on_2x2_equals_zero3_on_4_ranks_step_by_step(cases, case):
    exact, default, zero3 = cases[case][0]
    assert exact["engine"] == default["engine"] == "ODCEngine" and zero3["engine"] == "DeepSpeedEngine"
    for rank_exact, rank_default, rank_zero3 in cases[case]:
        for odc in (rank_exact, rank_default):
            for a, b in zip(odc["losses"], rank_zero3["losses"], strict=True):
                assert abs(a - b) <= FP32_TOL * max(abs(b), 1e-12), (case, a, b)
    for step in range(len(zero3["params"])):
        for run, grad_tol in ((exact, FP32_TOL), (default, FP32_ARRIVAL_ORDER_TOL)):
            assert worst_rel_diff(run["grads"][step], zero3["grads"][step]) <= grad_tol, (case, step)
            assert worst_rel_diff(run["params"][step], zero3["params"][step]) <= FP32_TOL, (case, step)
    assert max_rel_diff(exact["params"][-1]["out.weight"], exact["params"][0]["out.weight"]) > 1e-4  # it trained


def test_odc_bf16_on_2x2_within_zero3_bf16_self_difference(cases):
    odc, zero3, zero3_fp32, odc_bf16 = cases["bf16_adam_gas1"][0]
    assert odc_bf16["window_dtypes"] == ("torch.bfloat16", "torch.bfloat16")  # ZeRO-3's gradient dtype
    assert odc["window_dtypes"] == ("torch.bfloat16", "torch.float32")
    for step in range(len(odc["params"])):
        zero3_self = worst_rel_diff(zero3["params"][step], zero3_fp32["params"][step])
        assert zero3_self > 0
        assert worst_rel_diff(odc["params"][step], zero3["params"][step]) <= zero3_self, step
        assert worst_rel_diff(odc_bf16["params"][step], zero3["params"][step]) <= zero3_self, step
        assert worst_rel_diff(odc["params"][step], zero3_fp32["params"][step]) <= 2 * zero3_self, step
    beyond = bf16_excess({"odc": odc, "odc bf16 accumulators": odc_bf16}, zero3, zero3_fp32, "grads", BF16_GRAD_SLACK)
    assert not beyond, beyond  # the summed gradients: parameters under Adam with clipping hide a gradient's scale


def test_offload_states_across_nodes_keeps_training_bit_identical(cases):
    """offload_states/reload_states on 2x2 ranks (windows sharded within each node, the accumulator reduced
    across nodes at the step), uneven counts, gradients pushed before the call: equal to the run without."""
    for rank, result in enumerate(cases["offload_states"]):
        plain, offloaded = result["plain"], result["offloaded"]
        assert_same_run(plain, offloaded, f"rank {rank}")


def test_deterministic_sums_repeat_bit_for_bit_across_nodes(cases):
    """odc.deterministic on 2x2 ranks, uneven counts (zero included), ranks starting each step in reversed orders
    in two runs: the same losses, summed gradients and parameters bit for bit (the fine and coarse regions are
    each reduced exactly across nodes, then folded), and the single-process step."""
    counts = UNEVEN["uneven_token"]
    expected = reference_training("token", counts, masked=MASKED)
    for rank, (first, second) in enumerate(cases["deterministic"]):
        assert first["exact"], rank
        assert_same_run(first, second, f"rank {rank}")
        assert worst_rel_diff(second["params"][-1], expected) <= FP32_TOL, rank


@pytest.mark.parametrize("case", UNEVEN_CASES)
def test_uneven_micro_batch_counts_across_nodes_equal_single_process(cases, case):
    mode = case.split("_")[1]
    counts = UNEVEN[case]
    expected = reference_training(mode, counts, masked=MASKED if mode == "token" else ())
    for rank, result in enumerate(cases[case]):
        diff = worst_rel_diff(result["params"], expected)
        assert diff <= FP32_TOL, f"{case} {counts}, rank {rank}: {diff:.2e} from the single-process reference"
        assert result["phase"] == "idle"


def test_collectives_per_step_constant_across_nodes_and_none_in_forward_backward(cases):
    """(layers, micro-batches) = (1, 1), (2, 1), (1, 2): four collectives per step on the cross-node
    group (counts, gradients, norm, updated shards) at every size; none in forward/backward after the
    open round (the first forward's: the windows gathered once, trainable and frozen)."""
    for rank, runs in enumerate(cases["collectives"]):
        for run in runs:
            assert run["step"] == [4, 4, 4], (rank, run)
            assert run["fwd_bwd"] == [2, 0, 0], (rank, run)
            assert run["exchanges"][1:] == [3, 3], (rank, run)  # the node's own rounds: fence, norm, publish


def test_per_rank_memory_window_and_accumulator_over_the_node_optimizer_state_over_the_job(cases):
    """The per-rank bytes of docs/memory.md, against what each rank allocated (bf16 model, Adam): the window
    holds every parameter's shard of each rank with its local rank (1/local_world of the model, in
    bf16), the accumulator the same for trainable ones in fp32, the optimizer state (fp32 master,
    exp_avg, exp_avg_sq) 1/world of the trainable parameters, as in ZeRO-3."""
    for result in cases["memory"]:
        world, local, nodes = result["world"], result["local_world"], result["world"] // result["local_world"]
        shard = lambda numel, world=world: -(-numel // world)  # noqa: E731 - ZeRO-3's padded partition
        trainable = sum(shard(n) for n in result["trainable"])
        frozen = sum(shard(n) for n in result["frozen"])
        assert result["window_bytes"] == 2 * nodes * (trainable + frozen), result
        assert result["accumulator_bytes"] == 4 * nodes * trainable, result
        assert result["optimizer_bytes"] == 12 * trainable, result
        # with the padding gone: c·P/local_world, 4·P_trainable/local_world, 12·P_trainable/world
        params, trainable_params = sum(result["trainable"] + result["frozen"]), sum(result["trainable"])
        assert 2 * params / local <= result["window_bytes"] < 2 * params / local * 1.01 + 2 * nodes * 8, result
        assert 12 * trainable_params / world <= result["optimizer_bytes"] < 12 * trainable_params / world * 1.01 + 96
        before, after = result["store_connections"]  # engine.destroy() closed the failure board's own connection
        assert before >= 2 and after == before - 1, result["store_connections"]


@pytest.mark.parametrize("saved,loaded", [("ckpt_save", "ckpt_load_1x2"), ("ckpt_save_1x2", "ckpt_load")],
                         ids=["2x2-to-1x2", "1x2-to-2x2"])
def test_checkpoint_moves_between_topologies_through_the_universal_checkpoint(cases, saved, loaded):
    """Saved on 2 nodes x 2 ranks and loaded on 2 ranks of one host, and the reverse: the same global batch
    per step (checkpoint_workloads.py), so the resumed run continues the uninterrupted one."""
    uninterrupted, resumed = cases[saved], cases[loaded]
    if saved == "ckpt_save":  # the 2x2 files are a 4-rank ZeRO-3 checkpoint: zero_to_fp32 reads them
        consolidated = cases["ckpt_2x2_zero_to_fp32"]
        trainable = {k: v for k, v in uninterrupted[0]["saved"].items() if k in consolidated}
        assert set(trainable) >= {"inp.weight", "inp.bias", "out.weight", "blocks.0.weight"}
        assert worst_rel_diff({k: consolidated[k].float() for k in trainable}, trainable) == 0.0
    rank0 = resumed[0]
    assert rank0["engine"] == "ODCEngine"
    assert worst_rel_diff(rank0["loaded"], uninterrupted[0]["saved"]) == 0.0
    assert rank0["loaded_adam_step"] == 3.0 and rank0["global_steps"] == 5 and rank0["lr"] == uninterrupted[0]["lr"]
    assert worst_rel_diff(rank0["final"], uninterrupted[0]["final"]) < RESHARD_TOLERANCE
    expected, got = merged_losses(uninterrupted), merged_losses(resumed)
    for step in (3, 4):
        for slot, loss in expected[step].items():
            assert got[step][slot] == pytest.approx(loss, rel=RESHARD_TOLERANCE), (step, slot)


def _launch_failure(hosts, tmp_path, case):
    """Start the failure case ``case`` (two_host_workloads.cases) on both hosts, 2 ranks each, by the launcher that
    leaves the survivors to find out (two_host_workloads.ranks: torchrun would stop them itself); its reports go
    to the returned folder."""
    out_dir = tmp_path / case
    out_dir.mkdir()
    port = str(next(_ports))
    argvs = [[sys.executable, SCRIPT, "ranks", str(i), "2", "4", hosts.master_addr, port, "cases", case,
              str(out_dir)] for i in range(2)]
    return out_dir, hosts.start_on_both(argvs)


def _run_failure(hosts, tmp_path, case):
    """:func:`_launch_failure`, then wait for both hosts: neither may reach the launch's bound."""
    out_dir, procs = _launch_failure(hosts, tmp_path, case)
    results = hosts.wait(procs, timeout=TRAIN_TIMEOUT_S)
    assert not any(result.timed_out for result in results), _logs(results)
    return out_dir


def test_a_rank_killed_on_node1_is_named_by_every_rank_of_both_nodes(hosts, tmp_path):
    """Rank 3 is SIGKILLed in a forward; ranks are started by a launcher that leaves the survivors to
    find out (torchrun would stop them itself). Every survivor's step raises naming rank 3 within
    seconds, and both hosts' /dev/shm are empty after engine.destroy()."""
    out_dir = _run_failure(hosts, tmp_path, "kill")
    reports = {r: json.loads((out_dir / f"kill_rank{r}.json").read_text()) for r in (0, 1, 2)}
    for r, report in reports.items():
        assert report["error"] == "ODCPeerError", (r, report)
        assert "rank 3" in report["message"] and "exited (killed, crashed, or its script ended)" in report["message"], \
            (r, report)
        assert report["waited_s"] < 15, (r, report)
        assert report["shm"] == [], (r, report)
    assert {report["host"] for report in reports.values()} == {"node0", "node1"}


def test_a_rank_killed_mid_save_on_node1_leaves_latest_naming_the_previous_checkpoint(hosts, tmp_path):
    """docs/multinode.md: no rank writes ``latest`` before every node's ranks have written their files. A second
    save in which rank 3 (node 1) dies while writing its optimizer shard (half written): ``latest`` still names the
    first save's tag, the second save had started, no temporary ``latest`` is left, and every survivor's save ends
    (raising, naming rank 3, or it would have had to complete every rank's files) within the launch's bound."""
    out_dir = _run_failure(hosts, tmp_path, "crash_mid_save")
    ckpt = out_dir / "ckpt"
    assert (ckpt / "global_step3").is_dir(), "the second save did not start"
    assert (ckpt / "latest").read_text() == "global_step2"
    assert not [name for name in os.listdir(ckpt) if name.startswith(".latest.")]
    reports = {r: json.loads((out_dir / f"save_rank{r}.json").read_text()) for r in (0, 1, 2)}
    for r, report in reports.items():
        assert report["second_save"] != "completed", (r, report)  # rank 3's files were never all written
        assert "rank 3" in report["second_save"], (r, report)
        assert report["waited_s"] < 60, (r, report)
        assert report["shm"] == [], (r, report)
    assert {report["host"] for report in reports.values()} == {"node0", "node1"}


def test_a_dev_shm_too_small_on_one_node_fails_every_rank_of_both_nodes_with_that_node_s_error(hosts, tmp_path):
    """Node 1's /dev/shm holds 16 KiB: its ranks' window allocation is refused there (naming the directory
    and the bytes needed), and node 0's ranks, whose own allocation succeeded, raise the same refusal
    naming node 1's rank and host at initialize, instead of losing their peers at the first step."""
    out_dir = tmp_path / "small_shm"
    out_dir.mkdir()
    port = str(next(_ports))
    argvs = [[sys.executable, SCRIPT, "ranks", str(i), "2", "4", hosts.master_addr, port, "cases", "small_shm",
              str(out_dir)] for i in range(2)]
    results = hosts.run_on_both(argvs, timeout=TRAIN_TIMEOUT_S, extra_env=[None, {"ODC_SHM_SIZE": "16k"}])
    logs = _logs(results)
    assert not any(result.timed_out for result in results), logs
    reports = {r: torch.load(out_dir / f"small_shm_rank{r}.pt") for r in range(4)}
    for r, report in reports.items():
        assert report["error"] == "ODCConfigError", (r, report, logs)
        assert "zero_optimization.odc.shm_dir='/dev/shm'" in report["message"] and "node1" in report["message"], \
            (r, report)
        assert report["shm"] == [], (r, report)  # nothing left on either node
    for r in (0, 1):
        assert reports[r]["host"] == "node0" and "on node1 failed while allocating" in reports[r]["message"], reports[r]


def test_the_two_node_example_runs_under_the_deepspeed_launcher_with_its_hostfile(hosts):
    """The README's several-node command, as each node runs it without ssh: examples/hostfile (node0, node1) and
    examples/ds_config_two_nodes_odc.json (``cross_node`` "auto" with a budget the example's model fits), unchanged."""
    port = str(next(_ports))
    argvs = [[os.path.join(BIN, "deepspeed"), "--hostfile", os.path.join("examples", "hostfile"), "--no_ssh",
              "--node_rank", str(i), "--master_addr", hosts.hosts[0].hostname, "--master_port", port,
              os.path.join("examples", "train_causal_lm.py"), "--steps", "3",
              "--deepspeed_config", os.path.join("examples", "ds_config_two_nodes_odc.json")] for i in range(2)]
    assert [host.hostname for host in hosts.hosts] == ["node0", "node1"]  # the names the example's hostfile uses
    results = hosts.run_on_both(argvs, timeout=TRAIN_TIMEOUT_S)
    logs = _logs(results)
    for result in results:
        assert not result.timed_out and result.returncode == 0, logs
    summary = re.search(r"engine: ODCEngine, zero stage 3, 4 ranks, .*, cross_node (\w+): (\w+)", results[0].output)
    assert summary and summary.groups() == ("auto", "replicate"), logs
    losses = [float(value) for value in re.findall(r"loss/token ([\d.]+)", results[0].output)]
    assert len(losses) == 3 and all(0 < loss < 10 for loss in losses), logs


def test_hf_trainer_on_2x2_trains_as_on_zero3(hosts, tmp_path):
    """The unmodified Trainer example under torchrun on both hosts, with its "odc" config and with the
    same config at "stage": 3: an ODCEngine on 4 ranks, the same logged losses, gradient norms and eval loss,
    and save_model's full weights."""
    with open(os.path.join("examples", "ds_config_hf_odc.json")) as f:
        config = json.load(f)
    runs = {}
    for stage in ("odc", 3):
        run_dir = tmp_path / f"stage_{stage}"
        run_dir.mkdir()
        config["zero_optimization"]["stage"] = stage
        (run_dir / "ds_config.json").write_text(json.dumps(config))
        port = str(next(_ports))
        argvs = [[os.path.join(BIN, "torchrun"), "--nnodes", "2", "--nproc_per_node", "2", "--node_rank", str(i),
                  "--master_addr", hosts.master_addr, "--master_port", port,
                  os.path.join("examples", "hf_trainer_sft.py"),
                  "--steps", "4", "--ds_config", str(run_dir / "ds_config.json"), "--output_dir", str(run_dir / "out")]
                 for i in range(2)]
        results = hosts.run_on_both(argvs, timeout=240)
        logs = _logs(results)
        for result in results:
            assert not result.timed_out and result.returncode == 0, logs
        output = results[0].output  # rank 0's lines (the progress bar may share their line)
        summary = re.findall(r"engine: \w+, zero stage 3, \d+ ranks", output)
        assert summary, logs
        logged = re.findall(r"step \d+/4 \| loss ([\d.]+) \| grad norm ([\d.]+)", output)
        losses, norms = [float(loss) for loss, _ in logged], [float(norm) for _, norm in logged]
        runs[stage] = (summary[0], losses, float(re.findall(r"\| eval loss ([\d.]+)", output)[0]), norms)
        assert os.path.getsize(run_dir / "out" / "model.safetensors") > 100_000
    odc, zero3 = runs["odc"], runs[3]
    assert odc[0] == "engine: ODCEngine, zero stage 3, 4 ranks", odc
    assert zero3[0] == "engine: DeepSpeedEngine, zero stage 3, 4 ranks", zero3
    assert len(odc[1]) == 4 and odc[1] == pytest.approx(zero3[1], abs=2e-4), (odc, zero3)  # printed to 4 decimals
    assert odc[2] == pytest.approx(zero3[2], abs=2e-4), (odc, zero3)
    # the gradient norm the Trainer logs before clipping: under AdamW with clipping, losses and weights alone
    # cannot show a gradient off by a factor
    assert len(odc[3]) == 4 and odc[3] == pytest.approx(zero3[3], rel=1e-3, abs=2e-4), (odc, zero3)
