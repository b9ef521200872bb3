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
import subprocess
import sys
import time

import pytest

from tests.distributed.netns import available, two_hosts

SCRIPT = os.path.join("tests", "distributed", "two_host_workloads.py")
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


def _launch(hosts, launcher, stage, out_dir, timeout=TRAIN_TIMEOUT_S):
    """Launch the training script on both nodes, as users do; returns (results, per-rank json files)."""
    out_dir.mkdir()
    port = str(next(_ports))
    script = [SCRIPT, "train", str(stage), str(out_dir)]
    if launcher == "torchrun":
        argvs = [[os.path.join(BIN, "torchrun"), "--nnodes", "2", "--nproc_per_node", "2", "--node_rank", str(i),
                  "--master_addr", hosts.master_addr, "--master_port", port, *script] for i in range(2)]
    else:
        hostfile = out_dir / "hostfile"
        hostfile.write_text("".join(f"{host.hostname} slots=2\n" for host in hosts.hosts))
        argvs = [[os.path.join(BIN, "deepspeed"), "--hostfile", str(hostfile), "--no_ssh", "--node_rank", str(i),
                  "--master_addr", hosts.hosts[0].hostname, "--master_port", port, *script] for i in range(2)]
    results = hosts.run_on_both(argvs, timeout=timeout)
    files = {}
    for path in out_dir.iterdir():
        if path.suffix == ".json":
            files[path.stem] = json.loads(path.read_text())
    return results, files


def _logs(results):
    return "\n".join(result.tail() for result in results)


def _check_training(results, files):
    logs = _logs(results)
    for result in results:
        assert not result.timed_out and result.returncode == 0, logs
    ranks = [files.get(f"rank{r}") for r in range(4)]
    assert all(ranks), f"missing rank results: {sorted(files)}\n{logs}"
    for r, rank in enumerate(ranks):
        assert rank["world"] == 4 and rank["env_world_size"] == "4" and rank["rank_sum"] == 6.0, rank
        assert rank["host"] == f"node{r // 2}" and rank["local_rank"] == str(r % 2), rank
        assert rank["shm"] == [], rank  # each node's own, fresh /dev/shm
        assert rank["engine"] == "DeepSpeedEngine", rank
    for key in ("mean_losses", "eval_losses"):  # all-reduced loss; loss of the same batch under each rank's weights
        assert all(rank[key] == pytest.approx(ranks[0][key], rel=1e-6) for rank in ranks), [r[key] for r in ranks]
    assert len({tuple(rank["losses"]) for rank in ranks}) == 4  # every rank trained on its own data
    return ranks


_zero3_losses = {}


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


def test_torchrun_across_two_hosts_trains_zero3(hosts, tmp_path):
    results, files = _launch(hosts, "torchrun", 3, tmp_path / "out")
    ranks = _check_training(results, files)
    _zero3_losses["torchrun"] = ranks[0]["mean_losses"]


def test_deepspeed_launcher_no_ssh_across_two_hosts_trains_zero3(hosts, tmp_path):
    results, files = _launch(hosts, "deepspeed", 3, tmp_path / "out")
    ranks = _check_training(results, files)
    if "torchrun" in _zero3_losses:  # the same job, whichever launcher started it
        assert ranks[0]["mean_losses"] == pytest.approx(_zero3_losses["torchrun"], rel=1e-6)


def test_odc_across_two_hosts_fails_at_initialize_naming_the_hosts(hosts, tmp_path):
    """Today the "odc" stage needs every rank on one host: across two hosts every rank gets past
    init_distributed and fails in deepspeed.initialize with an ODCConfigError naming both hosts,
    and both launchers exit non-zero, well before the bound; nothing hangs."""
    started = time.monotonic()
    results, files = _launch(hosts, "torchrun", "odc", tmp_path / "out")
    logs = _logs(results)
    assert time.monotonic() - started < TRAIN_TIMEOUT_S
    for result in results:
        assert not result.timed_out, logs
        assert result.returncode not in (0, None), logs
        assert "ODCConfigError: the odc stage needs every rank on one host today" in result.output, logs
    assert all(f"hello{r}" in files for r in range(4)), f"a rank did not reach initialize: {sorted(files)}\n{logs}"
    assert not any(f"rank{r}" in files for r in range(4)), sorted(files)
    errors = {r: files[f"error{r}"] for r in range(4) if f"error{r}" in files}
    # the launcher stops a node's other rank once one has failed: at least one report per node
    assert {e["host"] for e in errors.values()} == {"node0", "node1"}, (errors, logs)
    for error in errors.values():
        assert error["error"].startswith("ODCConfigError: the odc stage needs every rank on one host today"), error
        assert "['node0', 'node1']" in error["error"], error
        assert "2 nodes x 2 ranks (node0: ranks 0-1; node1: ranks 2-3)" in error["error"], error
