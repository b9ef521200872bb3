"""The data of a combination job (the same in the ranks and here), its one-process reference, and the judgement of
what the ranks did (test_combinations.py, run_combinations.py).

The reference runs every sample of every step whole and alone in one process, in fp32, plain PyTorch, and normalises
each step's summed gradient as docs/normalisation.md says the engine does for the job's rule; then DeepSpeed's
clipping arithmetic and the torch optimizer DeepSpeed builds for the job. Nothing of DeepSpeed or ds_odc runs here.
"""
from __future__ import annotations

import math
from typing import Dict, List, Optional

import torch
import torch.nn.functional as F

from tests.support import tiny_models
from tests.support.combination_jobs import NEW_TOKENS, Job, StepLayout, expected_refusal, judged_against_zero3

VOCAB, IGNORE = 61, -100
MODEL_SEED, RESUMED_SEED, REFERENCE_SEED = 7, 999, 11
#: weight of the frozen reference model's term in the loss (a squared distance to its logits, per loss token)
BETA = 0.5
#: Adam's learning rate is 1e-3: Adam moves every element by up to the learning rate whatever its gradient's size, so
#: an element whose gradient is tiny (an embedding row seen once) carries the rounding of its sum into the parameter
#: at that scale (1.9e-5 measured at 1e-2, DeepSpeed's FusedAdam, 3 steps); a micro-batch lost or counted twice still
#: moves Adam's parameters by ~1e-3.
LR = {"sgd": 0.05, "adamw": 1e-3, "fused-adam": 1e-3}
CLIP = {"off": 0.0, "engaged": 0.05, "idle": 100.0}
#: Adam's epsilon, 1e-6 rather than torch's 1e-8: Adam divides each gradient by its own magnitude, so where that is a
#: few 1e-8 (a cancellation-heavy element) the last bits of the sum, which depend on its order, move the parameter
#: by up to the learning rate (measured: reversing the order of a step's micro-batches alone moved Adam's parameters
#: by up to 6.5e-6 with 1e-8, 1.4e-6 with 1e-6). The engine sums in another order than one process does.
ADAM_EPS = 1e-6

# fp32 bars. The ranks and this process compute the same sums in other orders and groupings: owners add pushes in
# arrival order, a packed or sliced micro-batch runs other kernels than a sample alone, a sequence-parallel or split
# sample's attention is computed on gathered heads. Each difference is a few fp32 roundings (~1e-7 relative) of a
# gradient, which the optimizer carries into the parameters: SGD as lr x the difference, Adam divided by the
# gradient's own magnitude (so an element whose gradient is a few 1e-8 moves up to ~1e-6 differently). Over 3 steps
# the worst difference measured over the fixed seed set is given in docs/combinations.md; 1e-5 absolute plus 1e-5
# relative leaves a margin of an order of magnitude while a normalisation error (a micro-batch counted twice or
# lost, a factor of the world size or of gradient_accumulation_steps) moves parameters by 1e-3 or more.
FP32_RTOL = FP32_ATOL = 1e-5
#: bf16 forwards and backwards round every activation to 8 bits of mantissa, so a bf16 run has no exact answer: the
#: bar is how far a bf16 run of the same job lands from the fp32 reference when it is right, measured on the job
#: itself: one process running it the way DeepSpeed runs bf16 (:func:`one_process` with ``bf16``), and ZeRO-3 in bf16
#: where ZeRO-3 can run it. Distances are relative L2 norms in units of the reference's movement (the max over
#: elements would say nothing: Adam turns the bf16 rounding of a near-zero gradient into a full step either way).
#: The odc stage may land this many times as far as the farther of them (the values measured are in
#: docs/combinations.md).
BF16_BAR = {"sgd": 0.05, "adamw": 0.15, "fused-adam": 0.15}
#: generate(): every token a rank produced must be the reference's argmax at its position, or within this many
#: logits of it (the logits differ by the parameters' difference: a tie may break the other way)
TOKEN_MARGIN = {"fp32": 1e-3, "bf16": 0.25}


def tiny_llama(seed: int = MODEL_SEED):
    return tiny_models.tiny_llama(VOCAB, seed, intermediate=48, max_positions=128, attn_implementation="sdpa",
                                  tie_word_embeddings=False)


# -- the data -----------------------------------------------------------------------------------------------------
def sample(job: Job, step: int, index: int):
    """Input ids and labels of one sample (unshifted, the first ``prompts[index]`` tokens without a label)."""
    layout = job.layout[step]
    g = torch.Generator().manual_seed(job.seed * 7919 + 1000 * step + index)
    length = layout.lengths[index]
    ids = torch.randint(0, VOCAB, (length,), generator=g)
    labels = ids.clone()
    labels[: layout.prompts[index]] = IGNORE
    return ids, labels


def packed(job: Job, step: int, samples) -> dict:
    """The samples of one micro-batch packed into one sequence (``position_ids`` restart per sample)."""
    pieces = [sample(job, step, i) for i in samples]
    lengths = job.layout[step].lengths
    return {"input_ids": torch.cat([ids for ids, _ in pieces]).unsqueeze(0),
            "labels": torch.cat([labels for _, labels in pieces]).unsqueeze(0),
            "position_ids": torch.cat([torch.arange(lengths[i]) for i in samples]).unsqueeze(0)}


def loss_sum(logits: torch.Tensor, shift_labels: torch.Tensor, reference_logits: Optional[torch.Tensor] = None):
    """The loss summed over the loss tokens (cross entropy, plus BETA x the mean squared distance to a frozen
    model's logits at each of them), and their count."""
    logits = logits.float().reshape(-1, VOCAB)
    labels = shift_labels.reshape(-1)
    total = F.cross_entropy(logits, labels, ignore_index=IGNORE, reduction="sum")
    if reference_logits is not None:
        mask = (labels != IGNORE).float()
        distance = ((logits - reference_logits.float().reshape(-1, VOCAB)) ** 2).mean(-1)
        total = total + BETA * (distance * mask).sum()
    return total, int((labels != IGNORE).sum())


def prompt(job: Job, rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(job.seed * 31 + rank)
    return torch.randint(3, VOCAB, (1, 4 + rank), generator=g)


def new_tokens(rank: int) -> int:
    return NEW_TOKENS[rank % len(NEW_TOKENS)]


# -- the reference ------------------------------------------------------------------------------------------------
def coefficient(job: Job, layout: StepLayout, entry_tokens: int) -> float:
    """What the engine multiplies a micro-batch's loss base by (the token sum, or its token mean for the "mean"
    loss), summed over the whole micro-batch (every slice, every member of a split or SP group): docs/normalisation.md
    with the SP rules of docs/sequence_parallel.md. ``N`` counts micro-batches (an SP group's or a split one once),
    ``T`` the step's loss tokens, ``dp`` the data-parallel degree (world / SP size)."""
    n, tokens, dp = len(layout.entries), layout.global_tokens, job.world // job.sp_size
    gas_division = 1.0 / job.gas if job.caller_divides_by_gas else 1.0
    if job.rule == "token":
        return 1.0 / tokens if tokens else 0.0
    if job.loss == "mean":
        # the engine: each SP rank's backward is a record of the fence, and each holds the gathered mean, whose
        # backward sums the SP copies: sp x the gradient over sp x N records (mean rule) or over the world (caller)
        return 1.0 / n if job.rule == "mean" else gas_division / dp
    # "scaled": each rank passes its slice's token sum x world / T; the slices add up to the micro-batch's
    scaled = job.world / max(tokens, 1)
    return scaled / (job.sp_size * n) if job.rule == "mean" else gas_division * scaled / job.world


def _optimizer(job: Job, params):
    if job.optimizer == "sgd":
        return torch.optim.SGD(params, lr=LR["sgd"], momentum=0.9)
    weight_decay = 0.01 if job.optimizer == "adamw" else 0.0
    return torch.optim.AdamW(params, lr=LR[job.optimizer], weight_decay=weight_decay, eps=ADAM_EPS)


def clip_like_deepspeed(parameters, clip: float) -> None:
    """ZeRO-3's clipping arithmetic: scale by max((||g|| + 1e-6) / clip, 1)."""
    grads = [p.grad for p in parameters if p.grad is not None]
    norm = torch.stack([g.double().norm(2) for g in grads]).pow(2).sum().sqrt().item()
    scale = max((norm + 1e-6) / clip, 1.0)
    for g in grads:
        g.mul_(1.0 / scale)


def _sample_loss(model, frozen, job: Job, step: int, index: int):
    ids, labels = sample(job, step, index)
    shift = F.pad(labels, (0, 1), value=IGNORE)[1:]
    reference_logits = None
    if frozen is not None:
        with torch.no_grad():
            reference_logits = frozen(input_ids=ids.unsqueeze(0)).logits
    return loss_sum(model(input_ids=ids.unsqueeze(0)).logits, shift, reference_logits)


def one_process(job: Job, generated: Optional[Dict[int, Dict[int, List[int]]]] = None, bf16: bool = False) -> dict:
    """Parameters after every step of ``job`` in one process on the same samples; with ``generated`` (step ->
    rank -> tokens the ranks generated before that step's micro-batches) each generated token's distance to this
    model's argmax at its position (0 where it is the argmax), teacher-forced on the rank's own tokens.

    ``bf16``: as ZeRO-3 and the odc stage run bf16, fp32 master weights (rounded to bf16 first, as DeepSpeed makes
    them from the bf16 model) copied into a bf16 model for every forward and backward, each micro-batch's bf16
    gradient added into fp32 sums, the step on the master weights. Its distance to the fp32 run is the bar of a
    bf16 job that ZeRO-3 cannot run."""
    model = tiny_llama(MODEL_SEED)
    frozen = tiny_llama(REFERENCE_SEED) if job.reference_model != "none" else None
    compute = model
    if bf16:
        for p in model.parameters():
            p.data = p.data.bfloat16().float()
        compute = tiny_llama(MODEL_SEED).bfloat16()
        frozen = frozen.bfloat16() if frozen is not None else None
    parameters = list(model.parameters())
    optimizer = _optimizer(job, parameters)
    clip = CLIP[job.clip]
    history, margins = [], {}
    for step, layout in enumerate(job.layout):
        if generated and step in generated:
            margins[step] = {rank: _token_margins(model, job, rank, tokens) for rank, tokens in generated[step].items()}
        if bf16:
            with torch.no_grad():
                for target, source in zip(compute.parameters(), parameters):
                    target.copy_(source)
        for p in list(parameters) + list(compute.parameters()):
            p.grad = None
        sums = [torch.zeros_like(p) for p in parameters]  # fp32, as the owners' accumulators
        for entry in layout.entries:
            losses = [_sample_loss(compute, frozen, job, step, i) for i in entry.samples]
            s = sum(value for value, _ in losses)
            t = sum(count for _, count in losses)
            base = s / max(t, 1) if job.loss == "mean" else s
            (coefficient(job, layout, t) * base).backward()
            for total, p in zip(sums, compute.parameters()):
                if p.grad is not None:
                    total.add_(p.grad.float())
                    p.grad = None
        for p, total in zip(parameters, sums):
            p.grad = total
        if clip > 0:
            clip_like_deepspeed(parameters, clip)
        optimizer.step()
        history.append({name: p.detach().clone() for name, p in model.named_parameters()})
    return {"params": history, "margins": margins}


def _token_margins(model, job: Job, rank: int, tokens: List[int]) -> List[float]:
    start = prompt(job, rank).shape[1]
    if tokens[:start] != prompt(job, rank)[0].tolist():
        return [math.inf]
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([tokens[:-1]])).logits[0].float()
    return [float(logits[position - 1].max() - logits[position - 1, tokens[position]])
            for position in range(start, len(tokens))]


# -- judging what the ranks did -----------------------------------------------------------------------------------
#: Defects the random search found whose fix lies in files others are changing now: name -> (which jobs show it,
#: what it looks like in a problem). A job whose every problem is a known defect's does not fail the fixed seeds'
#: test, which ends as xfail naming it; once no job shows it any more the test fails, so that the entry goes. Each has
#: a regression test of its own in test_combinations.py (xfail, strict).
KNOWN_DEFECTS: dict = {}


def known_defects(job: Job, problems: List[str]) -> List[str]:
    """The known defects that explain every one of ``problems`` (empty if any problem is unexplained)."""
    names = set()
    for problem in problems:
        matching = [name for name, (shows, looks) in KNOWN_DEFECTS.items() if shows(job) and looks(problem)]
        if not matching:
            return []
        names.update(matching)
    return sorted(names)


PEER_ERRORS = ("ODCPeerError", "ODCGroupFailedError", "ODCTimeoutError")


def _movement(params: List[dict], initial: dict) -> float:
    return max(float((step[name] - initial[name]).abs().max()) for step in params for name in step)


def param_gap(actual: List[dict], expected: List[dict], rtol: float = 0.0) -> tuple:
    """(worst excess over ``atol + rtol·|expected|`` as an absolute difference, its step and name), over every step.
    With rtol 0: the worst absolute difference."""
    worst = (0.0, None, None)
    for step, (ours, theirs) in enumerate(zip(actual, expected)):
        if ours.keys() != theirs.keys():
            return (math.inf, step, sorted(set(ours) ^ set(theirs)))
        for name in theirs:
            a, b = ours[name].double(), theirs[name].double()
            if a.shape != b.shape:
                return (math.inf, step, name)
            excess = float(((a - b).abs() - rtol * b.abs()).max())
            if not math.isfinite(excess) or excess > worst[0]:
                worst = (excess if math.isfinite(excess) else math.inf, step, name)
    return worst


def judge(job: Job, records: List[dict], references: Dict[str, dict], initial: Optional[dict] = None) -> List[str]:
    """Everything wrong with what the ranks did with ``job`` (empty: all good). ``records``: one per rank (see
    combination_workloads.run_jobs); ``references``: :func:`one_process` of the job in fp32 (``"fp32"``) and, for a
    bf16 job, in bf16 (``"bf16"``); empty when the job must be refused. ``initial``: the model's initial parameters."""
    problems: List[str] = []
    for rank, record in enumerate(records):
        if record.get("leftovers"):
            problems.append(f"rank {rank}: left in the shm_dir: {record['leftovers']}")
        if any(record.get("new_resources", {}).values()):
            problems.append(f"rank {rank}: left behind in the rank's process: {record['new_resources']}")
    refusal = expected_refusal(job)
    runs = [record["odc"] for record in records]
    if refusal is not None:
        return problems + _judge_refusal(refusal, runs)
    failed = [(rank, run) for rank, run in enumerate(runs) if run["outcome"] != "ok"]
    if failed:
        return problems + [f"rank {rank}: refused or failed in {run['phase']} ({job.rule} rule): {run['type']}: "
                           f"{run['message']}\n{run.get('traceback', '')}" for rank, run in failed]
    for rank, run in enumerate(runs[1:], start=1):  # every rank gathers the same full parameters
        gap = param_gap(run["params"], runs[0]["params"])
        if gap[0] > 0:
            problems.append(f"rank {rank}'s parameters differ from rank 0's by {gap[0]:.3e} at step {gap[1]} "
                            f"({gap[2]})")
    zero3 = records[0].get("zero3")
    if zero3 is not None and zero3["outcome"] != "ok":
        problems.append(f"ZeRO-3 failed on the same job: {zero3['type']}: {zero3['message']}")
        zero3 = None
    problems += compare(job, runs[0]["params"], references, initial, zero3["params"] if zero3 else None)
    for step, per_rank in references["fp32"].get("margins", {}).items():
        for rank, margins in per_rank.items():
            if any(m > TOKEN_MARGIN[job.dtype] for m in margins):
                problems.append(f"rank {rank}: generate() before step {step} gave tokens {runs[rank]['tokens'][step]} "
                                f"the reference model does not (logit margins {['%.2g' % m for m in margins]})")
    return problems


def _judge_refusal(refusal, runs: List[dict]) -> List[str]:
    problems = []
    errors = [run for run in runs if run["outcome"] == "error"]
    if len(errors) != len(runs):
        trained = [rank for rank, run in enumerate(runs) if run["outcome"] == "ok"]
        problems.append(f"expected refused ({refusal.reason}: '{refusal.fragment}'), but rank(s) {trained} trained")
    named = [(rank, run) for rank, run in enumerate(runs) if run["outcome"] == "error"
             and refusal.fragment in run["message"]]
    if not named and errors:
        problems.append(f"expected refused ({refusal.reason}: '{refusal.fragment}'); got: " + "; ".join(
            f"rank {r}: {run.get('type')}: {run.get('message')}" for r, run in enumerate(runs)))
    for rank, run in enumerate(runs):
        if run["outcome"] == "error" and refusal.fragment not in run["message"] and run["type"] not in PEER_ERRORS:
            problems.append(f"rank {rank}: neither the refusal nor a peer's error: {run['type']}: {run['message']}\n"
                            f"{run.get('traceback', '')}")
    for rank, run in named:
        if run["phase"] != refusal.phase:
            problems.append(f"rank {rank}: refused in {run['phase']}, expected in {refusal.phase}")
    return problems


def relative_distance(actual: List[dict], expected: List[dict], initial: dict) -> float:
    """The worst step's ||actual - expected|| / ||expected - initial|| over all parameters: how far from the
    reference, in units of how far the reference moved."""
    worst = 0.0
    for ours, theirs in zip(actual, expected):
        off = math.sqrt(sum(float((ours[n].double() - theirs[n].double()).pow(2).sum()) for n in theirs))
        moved = math.sqrt(sum(float((theirs[n].double() - initial[n].double()).pow(2).sum()) for n in theirs))
        worst = max(worst, off / moved if moved > 0 else (0.0 if off == 0 else math.inf))
    return worst


def compare(job: Job, ours: List[dict], references: Dict[str, dict], initial: Optional[dict],
            zero3: Optional[List[dict]]) -> List[str]:
    """The odc stage's parameters against the references (and ZeRO-3's, where it ran), every step."""
    expected = references["fp32"]["params"]
    if len(ours) != len(expected):
        return [f"{len(ours)} steps recorded, {len(expected)} expected"]
    problems = []
    if job.dtype == "fp32":
        for what, theirs in (("one process", expected), ("ZeRO-3", zero3)):
            if theirs is None:
                continue
            gap = param_gap(ours, theirs, FP32_RTOL)
            if gap[0] > FP32_ATOL:
                problems.append(f"parameters differ from {what} by {gap[0]:.3e} beyond rtol {FP32_RTOL} (bar "
                                f"{FP32_ATOL}) at step {gap[1]} ({gap[2]})")
        return problems
    assert initial is not None
    start = {name: value.bfloat16().float() for name, value in initial.items()}  # DeepSpeed's bf16 master weights
    expected = references["bf16"]["params"]
    ours_off = relative_distance(ours, expected, start)
    if _debug():
        extra = f", ZeRO-3 {relative_distance(zero3, expected, start):.3e}" if zero3 is not None else ""
        print(f"    bf16 {job.optimizer}: odc {ours_off:.3e}{extra}, fp32 one process "
              f"{relative_distance(references['fp32']['params'], expected, start):.3e}")
    bar = BF16_BAR[job.optimizer]
    if not ours_off <= bar:
        problems.append(f"bf16 parameters are {ours_off:.3e} of the bf16 reference's movement away from it (bar "
                        f"{bar:g} with {job.optimizer})")
    return problems


def _debug() -> bool:
    import os

    return bool(os.environ.get("COMBINATIONS_DEBUG"))


# -- running seeds in a world of ranks and judging them ----------------------------------------------------------
def initial_params() -> dict:
    return {name: p.detach().clone() for name, p in tiny_llama(MODEL_SEED).named_parameters()}


def run_seeds(seeds, workdir: str, zero3: bool = True, job_timeout: float = 240.0, pg_timeout_s: float = 90.0,
              on_result=None) -> Dict[int, List[str]]:
    """:func:`run_jobs` of the jobs drawn from ``seeds``; seed -> problems."""
    from tests.support.combination_jobs import draw

    verdicts = run_jobs([draw(seed) for seed in seeds], workdir, zero3, job_timeout, pg_timeout_s, on_result)
    return {job.seed: problems for job, problems in verdicts}


def run_jobs(jobs: List[Job], workdir: str, zero3: bool = True, job_timeout: float = 240.0,
             pg_timeout_s: float = 90.0, on_result=None) -> List[tuple]:
    """Run ``jobs`` in one world of ranks after the other (re-starting a world after one that hung or died, from the
    next job on) and judge each. Returns (job, problems) in order (no problem: good). ``on_result(job, problems,
    records)`` is called as each job is judged (records None for the job the ranks hung or died in). A world is
    given ``job_timeout`` seconds per job it runs, plus a minute to start (a job that fails raises within odc's
    ``timeout_s`` of 30 s, or the process group's ``pg_timeout_s``; the rest is a loaded machine's slack)."""
    import os
    import shutil
    import tempfile

    from tests.support.combination_workloads import run_jobs as run_on_ranks
    from tests.support.harness import run_ranks

    verdicts: List[tuple] = []
    pending = list(jobs)
    initial = initial_params()
    while pending:
        out_dir = tempfile.mkdtemp(prefix="combinations_", dir=workdir)
        shm_dir = tempfile.mkdtemp(prefix="odc_combinations_", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
        try:  # the directories go on every exit: a failing report, an interrupt, a world that died
            world_error = None
            try:
                run_ranks(run_on_ranks, pending[0].world, pending, out_dir, shm_dir, os.path.join(out_dir, "ckpt"),
                          zero3, timeout=60 + job_timeout * len(pending), pg_timeout_s=pg_timeout_s)
            except AssertionError as err:  # RankHang / RankFailure: judged below from what the ranks wrote
                world_error = str(err)
            finished = 0
            for index, job in enumerate(pending):
                paths = [os.path.join(out_dir, f"job{index}_rank{rank}.pt") for rank in range(job.world)]
                if not all(os.path.exists(path) for path in paths):
                    break
                records = [torch.load(path, weights_only=False) for path in paths]
                problems = judge_records(job, records, initial)
                if zero3 and judged_against_zero3(job) and "zero3" not in records[0]:
                    problems.append("ZeRO-3 did not run a job it can run (its numbers were not compared)")
                verdicts.append((job, problems))
                if on_result is not None:
                    on_result(job, problems, records)
                finished += 1
            if finished < len(pending):  # the job that was running when the world hung or died
                job = pending[finished]
                verdicts.append((job, [f"the ranks hung or died in this job: {world_error}"]))
                if on_result is not None:
                    on_result(job, verdicts[-1][1], None)
                finished += 1
            pending = pending[finished:]
            leftovers = os.listdir(shm_dir)
            if leftovers and verdicts:
                verdicts[-1][1].append(f"left in the shm_dir at the end of the world: {leftovers}")
        finally:
            shutil.rmtree(out_dir, ignore_errors=True)
            shutil.rmtree(shm_dir, ignore_errors=True)
    return verdicts


def judge_records(job: Job, records: List[dict], initial: dict) -> List[str]:
    """:func:`judge` with the references the job needs, computed here."""
    references = {}
    if expected_refusal(job) is None and all(r["odc"]["outcome"] == "ok" for r in records):
        generated = {step: {rank: records[rank]["odc"]["tokens"][step] for rank in range(job.world)}
                     for step in records[0]["odc"]["tokens"] if isinstance(step, int)}
        references["fp32"] = one_process(job, generated)
        if job.dtype == "bf16":
            references["bf16"] = one_process(job, bf16=True)
    return judge(job, records, references, initial)
