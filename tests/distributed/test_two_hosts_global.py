"""``cross_node: "global"`` on two real hosts (2 nodes x 2 ranks; see netns.py and test_two_hosts.py): every
rank holds only its own 1/world of the windows, pulls and pushes reach owners on the other node one-sided
(ds_odc/comm/remote.py), and the step moves no gradients or shards between nodes.

One torchrun job runs every training case in turn (start-up is most of a case's time); the failure cases
are launches of their own, by a launcher that leaves the survivors to find out."""
import json
import os

import pytest
import torch

from tests.distributed.test_two_hosts import (  # noqa: F401 - hosts: the module's host pair fixture
    BIN,
    SCRIPT,
    TRAIN_TIMEOUT_S,
    _launch_failure,
    _logs,
    _ports,
    hosts,
)
from tests.support.compare import (
    BF16_GRAD_SLACK,
    assert_close_nested,
    bf16_excess,
    max_rel_diff,
    same_bits,
    worst_rel_diff,
)
from tests.support.netns import available
from tests.support.two_host_workloads import MASKED, UNEVEN
from tests.support.workloads import reference_training

FP32_TOL = 1e-6  # the parity bars of test_two_hosts.py
FP32_ARRIVAL_ORDER_TOL = 4e-6
CASES = ("global_adam_gas3", "global_bf16_adam_gas1", "global_uneven_unmanaged", "global_uneven_managed",
         "global_uneven_token", "global_collectives", "global_traffic", "global_memory", "global_refusals",
         "global_frozen", "global_bitwise", "global_delayed", "global_auto", "auto_replicate_uneven",
         "auto_global_uneven",
         # cross_node "budget": whole layers replicated per node, the rest global (tests at the end of this file)
         "budget_adam_gas3", "budget_uneven_unmanaged", "budget_collectives", "budget_shape")

_ok, _reason = available()
pytestmark = pytest.mark.skipif(not _ok, reason=f"cannot create two hosts (network/mount/UTS namespaces): {_reason}")


@pytest.fixture(scope="module")
def cases(hosts, tmp_path_factory):  # noqa: F811 - the module's host pair
    out_dir = tmp_path_factory.mktemp("global_cases")
    names = CASES + (f"global_ckpt:{tmp_path_factory.mktemp('global_ckpt')}",
                     f"budget_ckpt:{tmp_path_factory.mktemp('budget_ckpt')}",
                     f"interleavings:{tmp_path_factory.mktemp('interleavings')}", "contracts", "deferred_close",
                     # last: a refused SP engine leaves its mpu registered for every later engine of the process
                     "global_sp_refusal", "sp_across_nodes")
    port = str(next(_ports))
    argvs = [[os.path.join(BIN, "torchrun"), "--nnodes", "2", "--nproc_per_node", "2", "--node_rank", str(i),
              "--master_addr", hosts.master_addr, "--master_port", port, SCRIPT, "cases", ",".join(names),
              str(out_dir)] for i in range(2)]
    results = hosts.run_on_both(argvs, timeout=480)
    logs = _logs(results)
    for result in results:
        assert not result.timed_out and result.returncode == 0, logs
    stems = [name.split(":")[0] for name in names]
    return {stem: [torch.load(out_dir / f"{stem}_rank{r}.pt", weights_only=False) for r in range(4)]
            for stem in stems}


@pytest.mark.parametrize("case", ("global_adam_gas3", "budget_adam_gas3"))
def test_global_sharding_on_2x2_equals_zero3_on_4_ranks_step_by_step(cases, case):
    """Adam, accumulation 3: losses, full gradients and parameters of every step against ZeRO-3 on the same
    4 ranks (fp64 accumulators: within ZeRO-3's own bar; fp32: within the arrival-order bar). Under global
    sharding, and under budget (some layers replicated per node, the rest global: with fp64 accumulators inp and
    blocks.0, with fp32 every unit but out.weight, the frozen layer included)."""
    exact, default, zero3 = cases[case][0]
    assert exact["engine"] == default["engine"] == "ODCEngine" and zero3["engine"] == "DeepSpeedEngine"
    mode = case.split("_")[0]
    assert all(odc["cross_node"] == mode for runs in cases[case] for odc in runs[:2])  # what ran is what was asked
    for rank_exact, rank_default, rank_zero3 in cases[case]:
        for odc in (rank_exact, rank_default):
            for a, b in zip(odc["losses"], rank_zero3["losses"], strict=True):
                assert abs(a - b) <= FP32_TOL * max(abs(b), 1e-12), (a, b)
    for step in range(len(zero3["params"])):
        for run, grad_tol in ((exact, FP32_TOL), (default, FP32_ARRIVAL_ORDER_TOL)):
            assert worst_rel_diff(run["grads"][step], zero3["grads"][step]) <= grad_tol, step
            assert worst_rel_diff(run["params"][step], zero3["params"][step]) <= FP32_TOL, step
    assert max_rel_diff(exact["params"][-1]["out.weight"], exact["params"][0]["out.weight"]) > 1e-4  # it trained


def test_global_sharding_bf16_within_zero3_bf16_self_difference(cases):
    odc, zero3, zero3_fp32, odc_bf16, budget_bf16 = cases["global_bf16_adam_gas1"][0]
    assert (odc["cross_node"], odc_bf16["cross_node"], budget_bf16["cross_node"]) == ("global", "global", "budget")
    assert budget_bf16["window_dtypes"] == ("torch.bfloat16", "torch.bfloat16")
    assert odc_bf16["window_dtypes"] == ("torch.bfloat16", "torch.bfloat16")  # ZeRO-3's gradient dtype
    for step in range(len(odc["params"])):
        zero3_self = worst_rel_diff(zero3["params"][step], zero3_fp32["params"][step])
        assert zero3_self > 0
        assert worst_rel_diff(odc["params"][step], zero3["params"][step]) <= zero3_self, step
        assert worst_rel_diff(odc_bf16["params"][step], zero3["params"][step]) <= zero3_self, step
        assert worst_rel_diff(budget_bf16["params"][step], zero3["params"][step]) <= zero3_self, step
    beyond = bf16_excess({"global": odc, "global bf16 accumulators": odc_bf16, "budget bf16 accumulators": budget_bf16},
                         zero3, zero3_fp32, "grads", BF16_GRAD_SLACK)
    assert not beyond, beyond  # the summed gradients: parameters under Adam with clipping hide a gradient's scale


@pytest.mark.parametrize("case", ("global_uneven_unmanaged", "global_uneven_managed", "global_uneven_token"))
def test_global_sharding_uneven_counts_across_nodes_equal_single_process(cases, case):
    """Ranks run (1, 3, 0, 2) and other counts, zero included, across the nodes: one process's training."""
    mode = case.split("_")[2]
    counts = UNEVEN[case[len("global_"):]]
    expected = reference_training(mode, counts, masked=MASKED if mode == "token" else ())
    for rank, result in enumerate(cases[case]):
        assert result["cross_node"] == "global", result["cross_node"]
        diff = worst_rel_diff(result["params"], expected)
        assert diff <= FP32_TOL, f"{case} {counts}, rank {rank}: {diff:.2e} from the single-process reference"
        assert result["phase"] == "idle"


@pytest.mark.parametrize("case,mode,counts", [("auto_replicate_uneven", "unmanaged", UNEVEN["uneven_unmanaged"]),
                                              ("auto_global_uneven", "managed", UNEVEN["uneven_managed"])])
def test_auto_trains_as_one_process_whichever_mode_it_resolves_to(cases, case, mode, counts):
    """cross_node "auto" resolved to replicate (no budget) sums gradients over the nodes at the step as replicate
    does, and resolved to global reaches owners on the other node: one process's training, uneven counts."""
    expected = reference_training(mode, counts)
    for rank, result in enumerate(cases[case]):
        assert result["cross_node"] == case.split("_")[1], result["cross_node"]
        diff = worst_rel_diff(result["params"], expected)
        assert diff <= FP32_TOL, f"{case} {counts}, rank {rank}: {diff:.2e} from the single-process reference"


def test_no_pull_sees_an_owner_mid_update_and_no_update_precedes_a_push_sent_to_it(cases):
    """Rank 3's updates are slowed and so is its serving of pushes from the other node: a rank that pulled
    before the owner had updated, or an owner that updated before every push had landed, would train away from
    one process (uneven counts, zero included)."""
    expected = reference_training("unmanaged", UNEVEN["uneven_unmanaged"])
    for rank, result in enumerate(cases["global_delayed"]):
        assert worst_rel_diff(result["params"], expected) <= FP32_TOL, rank


def test_global_budget_and_replicate_give_the_same_bits_under_deterministic_sums(cases):
    """odc.deterministic sums in an order-free way, so the three layouts, whose pushes arrive in different orders
    and are summed in different places (a node's accumulator then a reduce-scatter, or the owner's directly, or
    per layer one or the other), must produce the same summed gradients at every step and the same parameters
    bit for bit, uneven counts included. The control: replicate and global with fp32 accumulators sum in other
    orders and places, and their gradients differ in some bits (parameters alone would hide it: an update far
    below a parameter's last bit leaves it unchanged)."""
    for rank, result in enumerate(cases["global_bitwise"]):
        replicate = result["replicate"]
        for layout in ("global", "budget"):
            other = result[layout]
            assert len(other["grads"]) == len(replicate["grads"]) == 3, rank
            for step, (a, b) in enumerate(zip(replicate["grads"], other["grads"], strict=True)):
                assert same_bits(a, b), ("gradients", layout, rank, step)
            assert same_bits(replicate["params"], other["params"]), ("parameters", layout, rank)
        plain, spread = result["replicate_fp32"]["grads"], result["global_fp32"]["grads"]
        assert not all(same_bits(a, b) for a, b in zip(plain, spread, strict=True)), rank


def test_global_sharding_runs_no_collective_in_forward_or_backward(cases):
    """After the open round, forward and backward issue no collective: the pulls and pushes across nodes are
    point-to-point messages (counted apart); the step keeps four small collectives on the cross-node group
    (counts, a barrier standing for the gradient sum, the norm, a barrier standing for the shards' gather)."""
    for rank, runs in enumerate(cases["global_collectives"]):
        for run in runs:
            assert run["fwd_bwd"][1:] == [0, 0], (rank, run)
            assert run["step"] == [4, 4, 4], (rank, run)
            assert all(messages > 0 for messages in run["messages"]), (rank, run)


def test_bytes_across_nodes_are_the_remote_owners_shards_of_what_was_pulled_and_pushed(cases):
    """The remote transport's byte counters against the layout: a rank reads from the other node exactly the
    shards its owners there hold of each parameter it pulled, and pushes exactly their part of each gradient;
    over the whole model that part is about (N-1)/N = 1/2 of every parameter (the formula of docs/multinode.md)."""
    for rank, result in enumerate(cases["global_traffic"]):
        assert result["pulled"] > 0 and result["pushed"] > 0, result
        assert result["bytes_read"] == result["expected_read"], (rank, result)
        assert result["bytes_pushed"] == result["expected_pushed"], (rank, result)
        assert 0.4 <= result["remote_of_every_param"] / result["params"] <= 0.6, result
        assert result["served"][0] > 0 and result["served"][1] > 0, result


def test_global_sharding_holds_one_world_share_per_rank_as_zero3_does(cases):
    """Window, accumulator and optimizer state are each 1/world of the model (bf16 window, fp32 accumulator,
    Adam), from what every rank allocated: ZeRO-3's partitions, not a node's. With bf16 accumulators every rank
    holds exactly what ZeRO-3 holds by default (16 bytes per parameter over the job)."""
    for result in cases["global_memory"]:
        world = result["world"]
        shard = lambda numel, world=world: -(-numel // world)  # noqa: E731 - ZeRO-3's padded partition
        trainable = sum(shard(n) for n in result["trainable"])
        frozen = sum(shard(n) for n in result["frozen"])
        fp32, bf16, zero3 = result["global"], result["global_bf16"], result["zero3"]
        assert fp32["param_bytes"] == 2 * (trainable + frozen), result
        assert fp32["gradient_bytes"] == 4 * trainable, result
        assert fp32["optimizer_bytes"] == 12 * trainable, result
        assert bf16 == {**fp32, "gradient_bytes": 2 * trainable}, result
        assert bf16 == zero3, result


@pytest.mark.parametrize("mode", ("odc", "budget"))
def test_frozen_engine_with_global_sharding_pulls_across_nodes_as_zero3_gathers(cases, mode):
    """A frozen engine (no optimizer), ranks running 2, 0, 1 and 3 forwards: ZeRO-3's outputs, under global
    sharding ("odc") and under budget (frozen layers replicated per node, the rest global)."""
    for rank, result in enumerate(cases["global_frozen"]):
        odc, zero3 = result[mode], result[3]
        assert odc["engine"] == "ODCEngine" and len(odc["outputs"]) == (2, 0, 1, 3)[rank]
        assert odc["mode"][0] == ("global" if mode == "odc" else "budget") and (mode == "odc" or odc["mode"][1] > 0)
        for a, b in zip(odc["outputs"], zero3["outputs"]):  # the same inputs, in the same order
            assert torch.equal(a, b), rank


def test_auto_replicates_within_the_budget_keeps_the_layers_that_fit_and_else_shards_globally_saying_why(cases):
    for rank, result in enumerate(cases["global_auto"]):
        assert result["no_budget"][0] == "replicate" and not result["no_budget"][2], (rank, result)
        assert result["large"][0] == "replicate" and not result["large"][2], (rank, result)
        mode, reason, remote = result["some"]
        assert mode == "budget" and remote and "layers replicated" in reason, (rank, reason)
        mode, reason, remote = result["small"]
        assert mode == "global" and remote and "budget" in reason and "global" in reason, (rank, reason)
        for name in ("no_budget", "some", "large"):  # each layout trains the same step as global sharding
            assert worst_rel_diff(result[f"{name}_params"], result["small_params"]) <= FP32_ARRIVAL_ORDER_TOL, name
        # the group for pulls across nodes (every rank's) is made only where owners are on the other node
        spread = result["small_world_groups"]
        assert result["some_world_groups"] == spread, result
        assert result["no_budget_world_groups"] == result["large_world_groups"] == spread - 1, result


@pytest.mark.parametrize("case", ("global_ckpt", "budget_ckpt"))
def test_a_checkpoint_saved_under_global_sharding_loads_back_and_training_continues(cases, case):
    """Saved after 3 steps on 2x2 ranks with global sharding (or budget), loaded into a fresh engine with other
    initial weights: the parameters at the save exactly, and the next 2 steps' losses and final parameters as the
    run that never stopped (the files are ZeRO-3's for 4 ranks, whatever the cross_node mode)."""
    from tests.support.checkpoint_workloads import RESHARD_TOLERANCE, merged_losses

    saved, loaded = [r["saved"] for r in cases[case]], [r["loaded"] for r in cases[case]]
    assert loaded[0]["engine"] == "ODCEngine"
    assert worst_rel_diff(loaded[0]["loaded"], saved[0]["saved"]) == 0.0
    assert loaded[0]["loaded_adam_step"] == 3.0 and loaded[0]["global_steps"] == 5
    assert worst_rel_diff(loaded[0]["final"], saved[0]["final"]) < RESHARD_TOLERANCE
    expected, got = merged_losses(saved), merged_losses(loaded)
    for step in (3, 4):
        for slot, loss in expected[step].items():
            assert got[step][slot] == pytest.approx(loss, rel=RESHARD_TOLERANCE), (step, slot)


def test_what_global_sharding_does_not_support_yet_is_refused_by_name(cases):
    for rank, result in enumerate(cases["global_refusals"]):
        error, message = result["offload_states"]
        assert error == "ODCConfigError" and "cross_node='global'" in message, (rank, message)
        assert result["phase"] == "idle"
        sp = cases["global_sp_refusal"][rank]
        for what, words, outcome in (("offload_param", "offload_param", result),
                                     ("offload_optimizer", "offload_optimizer", result),
                                     ("split", "lb-mini-split", result),
                                     ("sequence_parallel", "sequence parallelism", sp)):
            assert outcome[what] is not None, (what, "was not refused")
            error, message = outcome[what]
            assert error == "ODCConfigError" and words in message and "cross_node='global'" in message, message
        assert result["shm"] == [] and sp["shm"] == [], (result, sp)


def test_job_wide_zero3_calls_across_nodes_equal_zero3_on_the_same_4_ranks_in_every_cross_node_mode(cases):
    """docs/multinode.md: gradient reads between backward and step, ``zero_grad`` between micro-batches and writes
    through ZeRO-3's collective APIs (``GatheredParameters`` with a modifier rank among them) are job-wide on
    several nodes. test_zero3_contracts.py's workloads on 2 x 2 ranks (tests/support/contracts_across_nodes.py):
    under replicate, global and budget, every rank observes what it observes on ZeRO-3 on the same 4 ranks, with
    the one-node test's bars (summation order differs: pushes against reduce-scatter)."""
    for result in cases["contracts"]:  # every rank's own observations
        zero3 = result["zero3"]
        for mode in ("replicate", "global", "budget"):
            ours = result[mode]
            assert_close_nested(ours["reads"], zero3["reads"], rtol=1e-5, atol=1e-6)
            assert_close_nested(ours["zero_grad"], zero3["zero_grad"], rtol=1e-5, atol=1e-6)
            # two Adam steps amplify the summation-order differences; the writes move values by > 0.1
            assert_close_nested(ours["writes"], zero3["writes"], rtol=1e-4, atol=1e-5)


def test_a_sequence_parallel_group_spanning_nodes_is_refused_by_name_on_every_rank(cases):
    """sp_size 4 on 2 x 2 ranks under the default cross_node (replicate): the one SP group spans both nodes, and
    every rank's initialize raises naming the group and the ranks that are not on its node (docs/sequence_parallel.md);
    nothing is left in either /dev/shm. It runs after global_sp_refusal, whose refused engine left its SP mpu
    registered in DeepSpeed (as this one does: hence both last in the job)."""
    for rank, result in enumerate(cases["sp_across_nodes"]):
        assert result["sp_size"] == 4 and result["mpu_left"], result
        assert result["sequence_parallel"] is not None, "an SP group spanning nodes was not refused"
        error, message = result["sequence_parallel"]
        other = "2, 3" if rank < 2 else "0, 1"
        assert error == "ODCError", (rank, error, message)
        assert f"sequence-parallel group 0 (ranks 0, 1, 2, 3) spans nodes (ranks {other} are not on this rank's " \
               "node)" in message, (rank, message)
        assert result["shm"] == [], (rank, result)


def test_a_closed_rank_keeps_serving_its_window_to_peers_on_other_nodes_until_they_have_closed(cases):
    """docs/multinode.md: a rank that closes while peers on other nodes may still read its window keeps it mapped
    until they have closed too. A frozen engine under global sharding; rank 3 (node 1) destroys its engine, rank 0
    (node 0) then runs 3 more forwards, pulling a quarter of every parameter from rank 3: each reads exactly the
    bytes it read before the destroy and gives the same output. Rank 3, after its destroy returned: its server
    thread still runs and it still maps its node's segments (their files were unlinked at start-up: /dev/shm is
    empty throughout; what is kept is the mapping, "(deleted)" in /proc/self/maps), and it served rank 0's reads;
    once rank 0 closed, the thread has ended and the segments are unmapped. Both /dev/shm empty at the end."""
    results = cases["deferred_close"]
    reader, closer = results[0], results[3]
    assert reader["mode"] == closer["mode"] == "global", (reader["mode"], closer["mode"])
    assert len(reader["outputs"]) == 3 and all(torch.equal(out, reader["first"]) for out in reader["outputs"])
    before, after = reader["pulled_before"], reader["pulled_after"]
    assert before and len(after) == 3 * len(before), (len(before), len(after))  # every forward pulled from rank 3
    for index, piece in enumerate(after):
        assert torch.equal(piece, before[index % len(before)]), index
    mine = closer["mine"]
    assert any(name.endswith("_params (deleted)") for name in mine), mine  # its window among them
    for state in ("after_destroy", "after_reads"):
        assert closer[state]["serving"] and closer[state]["mapped"] == mine, (state, closer[state])
    assert closer["after_destroy"]["served"] == 0, closer["after_destroy"]  # nobody pulled during its destroy
    assert closer["after_reads"]["served"] == len(after), closer["after_reads"]  # rank 0's reads, served after it
    done = closer["after_all_closed"]
    assert not done["serving"] and done["mapped"] == [], done
    for rank, result in enumerate(results):
        assert result["shm"] == [], (rank, result)
    assert all(closer[state]["shm"] == [] for state in ("after_destroy", "after_reads", "after_all_closed"))


#: the failure cases run under global sharding and under the budget (budget_workloads.BUDGET: every layer but
#: out.weight replicated per node, out.weight global), whose step runs BudgetLink's list-form collectives. By
#: default the budget runs only where its paths differ from global's (a kill as the victim enters the replicated
#: layers' reduce-scatter or all-gather, a stall inside the reduce-scatter): its pulls and pushes across nodes are
#: global's RemoteWindows, and a kill before the step meets the fence round first. ODC_TWO_HOSTS_EVERY_MODE=1
#: runs every case under both (measured 2026-11-29: all pass, 13 launches, about 10 more minutes).
EVERY_MODE = os.environ.get("ODC_TWO_HOSTS_EVERY_MODE") == "1"
FAILURE_MODES = ("global", "budget") if EVERY_MODE else ("global",)


def _reports(out_dir, name, ranks, logs) -> dict:
    assert all((out_dir / f"{name}_rank{r}.json").exists() for r in ranks), logs
    return {r: json.loads((out_dir / f"{name}_rank{r}.json").read_text()) for r in ranks}


#: "every survivor raises naming it within a second" (a kill inside the budget's step): 1 s, with slack for a loaded
#: 2-core machine running another test beside it (measured 0.05 to 0.12 s after the kill, 2026-12-08)
KILL_IN_STEP_BOUND_S = 3.0
#: a cut network: "every rank of both nodes raises within about 2·timeout_s" (timeout_s 5 in the failure cases;
#: measured 10.03 to 10.04 s, the two bounded waits themselves, 2026-12-08), plus slack for a loaded machine
CUT_TIMEOUT_S = 5.0
CUT_BOUND_S = 2 * CUT_TIMEOUT_S + 5.0


@pytest.mark.parametrize("case", [f"{mode}_kill_{where}" for mode in FAILURE_MODES
                                  for where in ("forward", "backward", "step")] + ["budget_kill_sum",
                                                                                  "budget_kill_gather"])
def test_a_remote_owner_killed_mid_pull_mid_push_or_at_the_step_is_named_by_every_rank(hosts, tmp_path,  # noqa: F811
                                                                                        case):
    """Rank 3 (node 1) is SIGKILLed before step 1's pulls, after its forward (the others' pushes into it then
    fail), or after its backward, right before ``engine.step()`` (the others are in the step's rounds and the
    cross-node collectives: under the budget, the replicated layers' reduce-scatter and all-gather). Every
    survivor, on both nodes, raises naming rank 3 within seconds, and both /dev/shm are empty after
    engine.destroy(). Killed inside the step under the budget (sum, gather), docs/multinode.md promises "within a
    second" of the kill: asserted below KILL_IN_STEP_BOUND_S (measured 0.05 to 0.12 s on 2 cores)."""
    where = case.rsplit("_", 1)[1]
    out_dir, procs = _launch_failure(hosts, tmp_path, case)
    results = hosts.wait(procs, timeout=TRAIN_TIMEOUT_S)
    logs = _logs(results)
    assert not any(result.timed_out for result in results), logs
    reports = _reports(out_dir, where, (0, 1, 2), logs)
    for r, report in reports.items():
        assert report["error"] in ("ODCPeerError", "ODCGroupFailedError"), (r, report, logs)
        assert "rank 3" in report["message"], (r, report)
        assert report["waited_s"] < 20, (r, report)
        if where in ("sum", "gather"):  # from the victim's clock as it died (CLOCK_MONOTONIC: one for both hosts)
            assert 0 < report["after_kill_s"] < KILL_IN_STEP_BOUND_S, (r, report)
        assert report["shm"] == [], (r, report)
    assert {report["host"] for report in reports.values()} == {"node0", "node1"}


@pytest.mark.parametrize("case", [f"{mode}_stalled" for mode in FAILURE_MODES] + ["budget_stalled_sum"])
def test_a_stalled_remote_owner_is_named_by_every_rank_within_the_bound(hosts, tmp_path, case):  # noqa: F811
    """Rank 3 stops (SIGSTOP) before step 1, or (budget_stalled_sum) inside the step as it enters the replicated
    layers' reduce-scatter, its partner rank 1 then waiting in that collective: the others' pulls from it, their
    rounds and that collective wait timeout_s (5 s), then every survivor raises naming rank 3; both /dev/shm
    empty."""
    import signal
    import time

    out_dir, procs = _launch_failure(hosts, tmp_path, case)
    end = time.monotonic() + TRAIN_TIMEOUT_S  # every survivor has named it: the stopped rank may go (it would
    while time.monotonic() < end and not all((out_dir / f"stalled_rank{r}.json").exists() for r in (0, 1, 2)):
        time.sleep(0.1)  # resume 30 s after it stopped, long after the bound asserted below)
    if (out_dir / "stopped_pid").exists():
        try:
            os.kill(int((out_dir / "stopped_pid").read_text()), signal.SIGKILL)
        except ProcessLookupError:
            pass
    results = hosts.wait(procs, timeout=TRAIN_TIMEOUT_S)
    logs = _logs(results)
    reports = _reports(out_dir, "stalled", (0, 1, 2), logs)
    for r, report in reports.items():
        assert report["error"] in ("ODCPeerError", "ODCTimeoutError", "ODCGroupFailedError"), (r, report, logs)
        assert "rank 3" in report["message"], (r, report)
        assert report["waited_s"] < 25, (r, report)  # timeout_s 5, plus the wait for the cause
        assert report["shm"] == [], (r, report)


@pytest.mark.parametrize("case", [f"{mode}_cut" for mode in FAILURE_MODES])
def test_a_cut_network_between_nodes_fails_every_rank_within_the_bound(hosts, tmp_path, case):  # noqa: F811
    """After step 0 the veth between the hosts goes down: step 1's pulls across nodes never complete. Every rank
    of both nodes raises within about 2·timeout_s (timeout_s 5: CUT_BOUND_S), naming a rank of the other node
    (docs/multinode.md), and leaves its node's /dev/shm empty. The link is brought back up for the next test."""
    import subprocess
    import time

    out_dir, procs = _launch_failure(hosts, tmp_path, case)
    end = time.monotonic() + 90
    while not all((out_dir / f"ready_rank{r}").exists() for r in range(4)) and time.monotonic() < end:
        time.sleep(0.05)
    host = hosts.hosts[1]
    subprocess.run(["ip", "-n", host.netns, "link", "set", host.ifname, "down"], check=True, timeout=10)
    try:
        (out_dir / "cut").write_text("")
        results = hosts.wait(procs, timeout=TRAIN_TIMEOUT_S)
    finally:
        subprocess.run(["ip", "-n", host.netns, "link", "set", host.ifname, "up"], check=True, timeout=10)
    logs = _logs(results)
    reports = _reports(out_dir, "cut", range(4), logs)
    for r, report in reports.items():
        assert report["error"] in ("ODCPeerError", "ODCTimeoutError", "ODCGroupFailedError"), (r, report, logs)
        other = (2, 3) if r < 2 else (0, 1)
        assert any(f"rank {o}" in report["message"] for o in other), (r, report)
        assert report["waited_s"] < CUT_BOUND_S, (r, report)
        assert report["shm"] == [], (r, report)


# -- cross_node "budget" ------------------------------------------------------------------------------------------
def test_budget_with_uneven_counts_across_nodes_equals_single_process(cases):
    """Ranks run (1, 3, 0, 2) micro-batches: one process's training."""
    expected = reference_training("unmanaged", UNEVEN["uneven_unmanaged"])
    for rank, result in enumerate(cases["budget_uneven_unmanaged"]):
        assert result["cross_node"] == "budget", result["cross_node"]
        assert worst_rel_diff(result["params"], expected) <= FP32_TOL, rank
        assert result["phase"] == "idle"


def test_budget_replicates_the_leading_layers_that_fit_frozen_ones_included_and_says_why(cases):
    for rank, result in enumerate(cases["budget_shape"]):
        assert result["mode"] == "budget", (rank, result["reason"])
        assert result["replicated_layers"] == ("inp.weight", "inp.bias", "blocks.0", "blocks.1", "frozen.weight",
                                               "frozen.bias"), result
        assert "frozen.weight" in result["replicated_params"] and "out.weight" not in result["replicated_params"]
        assert "6 of 7 layers replicated" in result["reason"], result["reason"]


def test_budget_bytes_across_nodes_are_exactly_the_non_replicated_remote_shards(cases):
    """The remote transport's byte counters in one micro-batch: what the layout says the other node's owners hold
    of each non-replicated parameter pulled and pushed, nothing for the replicated ones (read in the node)."""
    for rank, result in enumerate(cases["budget_shape"]):
        assert result["pulled_replicated"] > 0 and result["pulled_global"] > 0, result
        assert result["bytes_read"] == result["expected_read"] > 0, (rank, result)
        assert result["bytes_pushed"] == result["expected_pushed"] > 0, (rank, result)


def test_budget_windows_hold_the_own_block_plus_one_replica_slot_per_other_node(cases):
    """From what every rank allocated (fp32 window and accumulator): ZeRO-3's partitions of every parameter, plus
    (N-1) copies of the replicated parameters' partitions; so (N-1)/W · ((c + a)·p_t + c·p_f) bytes beyond global
    sharding for the replicated layers, the planner's formula, with ZeRO-3's padding."""
    for result in cases["budget_shape"]:
        world, nodes = result["world"], 2
        shard = lambda numel, world=world: -(-numel // world)  # noqa: E731 - ZeRO-3's padded partition
        params, replicated = result["params"], set(result["replicated_params"])
        own = sum(shard(numel) for numel, _ in params.values())
        own_trainable = sum(shard(numel) for numel, trainable in params.values() if trainable)
        copies = sum(shard(params[name][0]) for name in replicated)
        copies_trainable = sum(shard(params[name][0]) for name in replicated if params[name][1])
        assert 0 < copies < own
        assert result["window_bytes"] == 4 * (own + (nodes - 1) * copies), result
        assert result["accumulator_bytes"] == 4 * (own_trainable + (nodes - 1) * copies_trainable), result


def test_budget_runs_no_collective_in_forward_or_backward(cases):
    """Forward and backward: no collective (pulls and pushes across nodes are point-to-point messages); the step
    keeps four collectives on the cross-node group: the counts, the replicated layers' reduce-scatter (standing
    for the gradient fence's barrier), the norm, their all-gather (standing for the publish barrier)."""
    for rank, run in enumerate(cases["budget_collectives"]):
        assert run["fwd_bwd"][1:] == [0, 0], (rank, run)
        assert run["step"] == [4, 4, 4], (rank, run)
        assert all(messages > 0 for messages in run["messages"]), (rank, run)


def test_what_budget_does_not_support_yet_is_refused_by_name(cases):
    for rank, result in enumerate(cases["budget_shape"]):
        error, message = result["offload_states"]
        assert error == "ODCConfigError" and "cross_node='budget'" in message, (rank, message)
        error, message = result["offload_param"]
        assert error == "ODCConfigError" and "offload_param" in message and "cross_node='budget'" in message, message


@pytest.mark.parametrize("mode", ["replicate", "global", "budget"])
def test_reads_and_writes_racing_a_faster_rank_across_nodes_equal_zero3(cases, mode):
    """Rank 1 reads (``get_fp32_grad_partitions``) or writes (``safe_set_full_grad``) gradients while a faster rank,
    on its node (replicate) or on the other node (global, budget), has already pushed its next micro-batch; and a
    ``zero_grad`` that the faster rank must not overtake.
    What rank 1 was handed does not move, and every step equals ZeRO-3's on the same 4 ranks ([Note: reads are
    snapshots]; tests/support/interleaving_workloads.py)."""
    for rank, result in enumerate(cases["interleavings"]):
        zero3, odc = result["zero3"], result[mode]
        for call, seen in odc.items():
            assert seen["cross_node"] == mode, (call, seen["cross_node"])
            assert not seen["pending"], (call, seen["pending"])
            if "still" in seen:
                for handed, still in zip(seen["handed"], seen["still"], strict=True):
                    assert torch.equal(handed, still), (rank, call)
                for a, b in zip(seen["handed"], zero3[call]["handed"], strict=True):
                    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
            assert worst_rel_diff(seen["grads"], zero3[call]["grads"]) <= 1e-5, (rank, call)
            assert worst_rel_diff(seen["params"], zero3[call]["params"]) <= 1e-5, (rank, call)
        [(_, signal, _)] = odc["zero_grad"]["held"] if rank == 1 else [(None, "", None)]
        assert signal == "", "the faster rank pushed while rank 1 was inside zero_grad"
