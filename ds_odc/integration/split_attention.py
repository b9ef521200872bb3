"""Long samples split over aligned groups on the odc stage (policy ``"lb-mini-split"``): the groups, the
attention hook, and one split micro-batch at a time. The plan is :mod:`ds_odc.balance.split`; the lockstep
:mod:`ds_odc.runtime.split_lockstep`.

A training engine whose ``zero_optimization.odc.balance.policy`` is ``"lb-mini-split"`` sets this up at
``deepspeed.initialize`` (every rank, collective):

* **Groups.** For every group size the plan may use (:func:`~ds_odc.balance.split_plan.group_sizes`, up to
  ``balance.max_group`` or what the model's heads allow) and every aligned block of it inside a node, one
  ``torch.distributed`` process group, created on every rank in the same order (``new_group`` is collective
  over the world). A rank belongs to at most three (groups of 2, 4 and 8).
* **Attention.** The model's attention implementation (``config._attn_implementation``, e.g. ``"sdpa"``) is
  replaced in transformers' ``ALL_ATTENTION_FUNCTIONS``, the hook ALST uses, by a function that runs the
  original for a whole micro-batch and, inside a split micro-batch, DeepSpeed's Ulysses attention
  (``UlyssesSPAttentionHF``, one per group this rank belongs to) over that micro-batch's group. The
  all-to-alls are DeepSpeed's, on those process groups (why not one-sided through ODC's windows:
  docs/balancing.md). Samples packed into one micro-batch, split or whole, attend each within itself
  (:func:`per_sample`: a sample's attention costs its own length squared; transformers' sdpa would mask a
  whole packed micro-batch densely and compute its total length squared, 3.5x the time for four ~1K samples).
* **Heads.** Ulysses needs the query heads to divide by the group and the key/value heads to divide it or by
  it: a ``max_group`` the model's heads do not allow is refused by name
  (:func:`~ds_odc.balance.split_plan.max_group_for_heads`).

Then each entry of a rank's list (``SplitPlan.for_rank``) runs inside ``engine.odc_micro_batch(entry)``: a
split entry points the attention at its group and takes the lockstep before each forward; its forward and
backward run there. Gradients go to the owners as usual (each member pushes its partial gradient, the owners'
accumulators sum them), and each member passes its own slice's loss sum and token count
(:func:`split_batch`), so per-token normalisation counts a split sample's tokens once.
"""
from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Callable, Optional

import torch

from ds_odc.balance.split_limits import SplitLimits
from ds_odc.balance.split_plan import max_group_for_heads
from ds_odc.errors import ODCConfigError, ODCError
from ds_odc.integration import sequence_parallel
from ds_odc.integration.packed_attention import check_attention_forms, is_packed, per_sample, text_config_of
from ds_odc.integration.patching import PatchSet
from ds_odc.runtime import LossNormalization
from ds_odc.runtime.split_lockstep import SplitLockstep

#: Attention implementations Ulysses cannot take over: eager builds a full 4-D mask, flex a block mask the
#: gathered sequence would need rebuilt.
REFUSED_IMPLEMENTATIONS = ("eager", "paged|eager", "flex_attention")


@dataclasses.dataclass(frozen=True)
class AttentionShape:
    """What Ulysses needs to know of a Hugging Face model's attention."""

    heads: int
    kv_heads: int
    head_dim: int
    layers: int
    implementation: str


def attention_shape(module: torch.nn.Module) -> AttentionShape:
    """The attention of the first Hugging Face model in ``module`` (itself or a submodule with a ``config``)."""
    for sub in module.modules():
        config = getattr(sub, "config", None)
        text = config.get_text_config() if config is not None and hasattr(config, "get_text_config") else config
        if text is not None and getattr(text, "num_attention_heads", None):
            heads = int(text.num_attention_heads)
            return AttentionShape(heads, int(getattr(text, "num_key_value_heads", None) or heads),
                                  int(getattr(text, "head_dim", None) or text.hidden_size // heads),
                                  int(text.num_hidden_layers), str(getattr(config, "_attn_implementation", "eager")))
    raise ODCConfigError("balance policy 'lb-mini-split' needs a Hugging Face model (a module with a config that has "
                         f"num_attention_heads) to split attention over ranks; {type(module).__name__} has none")


def check_group(shape: AttentionShape, max_group: Optional[int]) -> int:
    """The largest group to split over: ``max_group`` if the model's heads allow it (else refused by name), or
    the largest the heads allow (at most 8) when None."""
    allowed = max_group_for_heads(shape.heads, shape.kv_heads, limit=8)
    if max_group is None:
        return allowed
    if max_group_for_heads(shape.heads, shape.kv_heads, limit=max_group) < max_group:
        raise ODCConfigError(f"zero_optimization.odc.balance.max_group={max_group}: the model has {shape.heads} query "
                             f"heads and {shape.kv_heads} key/value heads, and Ulysses attention over a group of "
                             f"{max_group} needs the query heads to divide by it and the key/value heads to divide it "
                             f"or by it; the largest group these heads allow is {allowed}"
                             + (" (none: the model cannot be split)" if allowed == 1 else ""))
    return max_group


class SplitRuntime:
    """This rank's groups, its Ulysses attention per group, the attention hook and the lockstep."""

    def __init__(self, shape: AttentionShape, limits: SplitLimits, rank: int, lockstep: SplitLockstep):
        self.shape, self.limits, self.lockstep, self.rank = shape, limits, lockstep, rank
        self.groups: dict[tuple[int, ...], Any] = {}  # members -> process group (this rank's only)
        self.attention: dict[tuple[int, ...], Any] = {}  # members -> UlyssesSPAttentionHF over them
        self.active: Optional[Any] = None  # the Ulysses attention of the split micro-batch running now
        self.forward_outstanding: Optional[int] = None  # a split micro-batch's training forward awaits backward
        self.scaled_token_sum = False  # the running split micro-batch's caller loss adds up over its slices
        self.patches = PatchSet("the odc stage's split attention")

    # -- setup (collective) ---------------------------------------------------------------------------------
    def create_groups(self) -> None:
        """One process group per aligned block of every allowed size, on every rank in the same order."""
        import torch.distributed as tdist
        from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        core = ALL_ATTENTION_FUNCTIONS[self.shape.implementation]
        shape = self.shape
        for p in self.limits.group_sizes:
            for g in self.limits.groups(p):
                members = tuple(range(g * p, (g + 1) * p))
                group = tdist.new_group(list(members))
                if self.rank not in members:
                    continue
                self.groups[members] = group
                ulysses = UlyssesSPAttentionHF(attn=per_sample(core), batch_size=1, attn_head_count=shape.heads,
                                               attn_head_size=shape.head_dim, kv_head_count=shape.kv_heads,
                                               num_hidden_layers=shape.layers, process_group=group,
                                               seq_length_is_variable=True)
                ulysses.core_attn_implementation = shape.implementation
                self.attention[members] = ulysses

    def install(self) -> None:
        """Replace the model's attention implementation in transformers' registry by :meth:`attend`."""
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        self.patches.replace_item(ALL_ATTENTION_FUNCTIONS, self.shape.implementation, self._dispatcher)

    def _dispatcher(self, core: Callable) -> Callable:
        separate = per_sample(core)

        def attend(module, query, key, value, attention_mask, *args, **kwargs):
            ulysses = self.active
            if ulysses is None:  # a whole micro-batch: packed samples, each within itself, as in a split one
                if query.shape[0] == 1 and is_packed(kwargs.get("position_ids")):
                    return separate(module, query, key, value, None, *args, **kwargs)
                return core(module, query, key, value, attention_mask, *args, **kwargs)
            if query.shape[0] != 1:
                raise ODCConfigError(f"a split micro-batch holds {query.shape[0]} sequences: pack its samples into "
                                     "one sequence (e.g. transformers' DataCollatorWithFlattening)")
            groups = getattr(module, "num_key_value_groups", None)
            try:  # Ulysses drops the slice's mask (per_sample attends each sample within itself)
                return ulysses(module, query, key, value, None, *args, **kwargs)
            finally:  # it sets the module's GQA factor for its replicated key/value heads; whole ones need ours
                if groups is not None:
                    module.num_key_value_groups = groups

        return attend

    def close(self) -> None:
        """Put the attention entry back and destroy this rank's split groups (their gloo threads and sockets):
        called by ``engine.destroy()``, when every member is past its last split micro-batch. Destroying a group
        is local to the rank; the other members destroy theirs in their own ``destroy()``."""
        import torch.distributed as tdist

        self.patches.undo()
        self.active = None
        groups, self.groups, self.attention = list(self.groups.values()), {}, {}
        # DeepSpeed's Ulysses registers each group by name for its all-to-all operator and never forgets it: the
        # registry would keep the group, and its gloo threads and sockets, alive past its destruction
        import deepspeed.sequence.layer as sequence_layer

        registry = getattr(sequence_layer, "_all_to_all_groups", None)
        for group in groups:
            if registry is not None and registry.get(group.group_name) is group:
                del registry[group.group_name]
            if tdist.is_initialized():
                tdist.destroy_process_group(group)

    # -- one micro-batch ------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def micro_batch(self, entry, scaled_token_sum: bool = False):
        """Run ``entry`` (a ``MicroBatch`` of ``SplitPlan.for_rank``: ``ranks``, ``sequence``) inside: a split
        one over its group (attention and lockstep), a whole one as usual. ``scaled_token_sum``: the caller's loss
        is the slice's token sum times a factor every member shares (:meth:`check_backward`)."""
        ranks = tuple(int(r) for r in entry.ranks)
        if self.rank not in ranks:
            raise ODCError(f"rank {self.rank} runs a micro-batch of ranks {ranks}: run only the entries of this "
                           "rank's own list (SplitPlan.for_rank)")
        if len(ranks) == 1:
            with self.lockstep.own_entry():
                yield
            return
        ulysses = self.attention.get(ranks)
        if ulysses is None:
            raise ODCConfigError(f"split micro-batch {entry.sequence} runs over ranks {ranks}, which is not a group "
                                 f"this engine created ({self.limits.describe()}): plan with the engine's limits, "
                                 "engine.odc_split_limits (BalancedBatchSampler(..., engine=engine) takes them)")
        if self.active is not None:
            raise ODCError("split micro-batches cannot nest: run one micro-batch at a time")
        with self.lockstep.inside(int(entry.sequence), ranks):
            self.active, self.scaled_token_sum = ulysses, scaled_token_sum
            try:
                yield
            finally:
                self.active, self.scaled_token_sum = None, False

    def shares_micro_batch(self) -> bool:
        """Whether this rank runs the current micro-batch as a member of a split one other than the first: the
        first member's record counts its samples, so ``global_samples`` counts them once."""
        entry = self.lockstep.entry
        return entry is not None and self.rank != min(entry.members)

    def note_forward(self, training: bool) -> None:
        """A training forward inside a split micro-batch must have its backward there too (checkpointed
        layers recompute their attention in backward, which must go over the same group)."""
        entry = self.lockstep.entry
        if training and entry is not None:
            self.forward_outstanding = entry.sequence

    def check_backward(self, rule: LossNormalization, route: str) -> None:
        """Before a backward pushes anything (``route``: ``engine.backward()`` or a torch-style
        ``loss.backward()``): a split micro-batch's backward runs inside it, and under a loss that weighs a split
        sample as it weighs whole. Each member's loss covers its slice and the owners sum the members' gradients,
        so the loss must add up over the slices: a token sum (the per-token rule), or the caller's token sum times
        a factor every member shares (``scaled_token_sum``). A mean over each slice would count the sample once
        per member, differently every step as the plan changes: refused by name, on every member alike."""
        if self.lockstep.entry is None and self.forward_outstanding is not None:
            sequence, self.forward_outstanding = self.forward_outstanding, None
            raise ODCError(f"the backward of split micro-batch {sequence} ran outside engine.odc_micro_batch(): run "
                           "a split micro-batch's forward and backward inside it (its recomputed attention, and its "
                           "all-to-alls' gradients, go over its group)")
        self.forward_outstanding = None
        entry = self.lockstep.entry
        if entry is None or rule is LossNormalization.TOKEN or \
                (rule is LossNormalization.CALLER and self.scaled_token_sum):
            return
        how = ("the mean over micro-batches (engine.backward(loss) with gradient_accumulation_steps > 1)"
               if rule is LossNormalization.MEAN else
               "a loss the caller scaled (scale_wrt_gas=False, unmanaged accumulation or gradient_accumulation_steps"
               " 1), which the engine cannot tell from a mean over the slice")
        raise ODCConfigError(f"{entry.title}: {route} under {how}: each member holds a slice of the sample, so a "
                             "mean would count the sample once per member. Pass the slice's loss sum and token "
                             "count (engine.backward(loss_sum, loss_tokens=n), or engine.set_loss_tokens(n) before "
                             "loss.backward()), or a loss that is the slice's token sum times a factor every member "
                             "shares, declared with engine.odc_micro_batch(entry, scaled_token_sum=True)")


def enable(engine, runtime, balance, timeout_s: float) -> SplitRuntime:
    """The split runtime of a training engine whose balance policy is "lb-mini-split" (see the module docstring);
    collective: every rank calls it at ``deepspeed.initialize``."""
    import torch.distributed as tdist

    from ds_odc.integration.surface import SPLIT_POLICY, require_feature

    require_feature(SPLIT_POLICY)  # the private names only this policy needs, on the installed releases
    shape = attention_shape(engine.module)
    if shape.implementation in REFUSED_IMPLEMENTATIONS:
        raise ODCConfigError(f"balance policy 'lb-mini-split' splits attention with Ulysses, which cannot take the "
                             f"model's attn_implementation={shape.implementation!r}: use 'sdpa' or a flash attention")
    check_attention_forms(text_config_of(engine.module), shape.implementation)  # windows, chunks, softcaps
    max_group = check_group(shape, getattr(balance, "max_group", None))
    other = sequence_parallel.live_split_lockstep()
    if other is not None:
        raise ODCConfigError("balance policy 'lb-mini-split': this process already has a training engine with the "
                             "split policy, and both would hook the same attention entry and share its split "
                             "micro-batches: destroy() that engine first, or give this one another balance policy")
    plane = runtime.transport.control_plane
    limits = SplitLimits(tdist.get_world_size(), min(plane.world_size, tdist.get_world_size()), max_group)
    split = SplitRuntime(shape, limits, tdist.get_rank(), runtime.split_lockstep(timeout_s))
    split.create_groups()
    split.install()
    return split
