"""``cross_node: "budget"``: the layer grouping and the window layout (ds_odc/runtime/replica_layout.py,
ds_odc/comm/replica_link.py), pure math, no processes."""
import pytest
import torch

from ds_odc.comm.replica_link import ReplicaBlocks, pack, unpack
from ds_odc.runtime.cross_node_plan import choose_replicated_layers
from ds_odc.runtime.layout import owner_slices
from ds_odc.runtime.replica_layout import BudgetLayout, group_layers, layer_name
from ds_odc.runtime.session import SessionPlan, Shard


@pytest.mark.parametrize("name, layer", [
    ("model.layers.0.self_attn.q_proj.weight", "model.layers.0"),
    ("model.layers.12.mlp.experts.layers.3.w1", "model.layers.12"),  # the outermost layer index
    ("transformer.h.5.ln_1.bias", "transformer.h.5"),
    ("blocks.1.weight", "blocks.1"),
    ("encoder.layer.2.attention.self.query.weight", "encoder.layer.2"),
    ("model.embed_tokens.weight", "model.embed_tokens.weight"),  # not in a layer: its own unit
    ("lm_head.weight", "lm_head.weight"),
    ("layers.weight", "layers.weight"),  # no index
    ("path.1.weight", "path.1.weight"),  # an index, but not of a layer list
])
def test_a_parameter_belongs_to_the_outermost_indexed_layer_or_is_its_own_unit(name, layer):
    assert layer_name(name) == layer


def test_layers_come_in_key_order_with_trainable_and_frozen_counted_apart():
    # keys are ZeRO-3's ds_id (module order); a layer's trainable params may sit in two param groups
    params = [(5, "out.weight", 21, True), (0, "inp.weight", 35, True), (2, "blocks.0.weight", 49, True),
              (3, "blocks.0.bias", 7, False), (1, "inp.bias", 7, True), (4, "blocks.1.weight", 49, True)]
    layers, members = group_layers(params)
    assert layers == [("inp.weight", 35, 0), ("inp.bias", 7, 0), ("blocks.0", 49, 7), ("blocks.1", 49, 0),
                      ("out.weight", 21, 0)]
    assert members["blocks.0"] == (2, 3) and members["out.weight"] == (5,)
    assert group_layers(list(reversed(params))) == (layers, members)  # whatever order they are listed in


def _layout(nodes=2):
    """Trainable A (keys 1, 11 elements) and B (2, 6) and frozen C (3, 5) on world 4: shards 3, 2, 2."""
    layout = BudgetLayout(nodes)
    layout.add_trainable(1, 11, 3)
    layout.add_trainable(2, 6, 2)
    layout.add_frozen(3, 5, 2)
    return layout


def test_budget_window_is_the_own_block_then_one_replica_slot_per_other_node():
    layout = _layout(nodes=3)
    layout.replicate({2, 3})
    # own block: A 0-2, B 3-4, C 5-6; replica slot: [B | C] (4 elements), one per other node
    assert layout.param_numel == 7 and layout.window_numel == 7 + 2 * 4
    assert layout.accumulator_numel == 5 + 2 * 2
    assert [layout.replica_param_offset(2, i) for i in (0, 1)] == [7, 11]
    assert [layout.replica_param_offset(3, i) for i in (0, 1)] == [9, 13]
    assert [layout.replica_grad_offset(2, i) for i in (0, 1)] == [5, 7]
    with pytest.raises(ValueError, match="frozen"):
        layout.replica_grad_offset(3, 0)
    blocks = layout.blocks
    assert blocks.trainable_runs == ((3, 2),) and blocks.frozen_runs == ((5, 2),)
    assert (blocks.replica_trainable, blocks.replica_frozen) == (2, 2)
    # the other nodes in order: a rank on node 1 keeps node 0's copies in slot 0, node 2's in slot 1
    assert [ReplicaBlocks.slot_of(n, 1) for n in (0, 2)] == [0, 1]
    with pytest.raises(ValueError, match="own"):
        ReplicaBlocks.slot_of(1, 1)


def test_nothing_replicated_is_global_sharding_and_everything_is_n_times_the_own_block():
    none, every = _layout(), _layout()
    none.replicate(set())
    every.replicate({1, 2, 3})
    assert (none.window_numel, none.accumulator_numel) == (7, 5)  # global's 1/world
    assert (every.window_numel, every.accumulator_numel) == (2 * 7, 2 * 5)  # replicate's N blocks
    assert every.blocks.trainable_runs == ((0, 5),)  # adjacent shards packed as one piece
    with pytest.raises(ValueError, match="not in the layout"):
        _layout().replicate({9})


def test_window_bytes_follow_the_planners_formula_for_the_replicated_layers():
    """Per rank beyond global: (N-1)/W · ((c + a)·p_t + c·p_f), with padded shards (p/W each) in the layout."""
    nodes, ranks_per_node, c, a = 2, 2, 2, 4
    world = nodes * ranks_per_node
    layout = BudgetLayout(nodes)
    layout.add_trainable(1, 8, 2)
    layout.add_trainable(2, 12, 3)
    layout.add_frozen(3, 4, 1)
    layout.replicate({2, 3})
    extra = (c * (layout.window_numel - layout.param_numel)
             + a * (layout.accumulator_numel - layout.trainable_numel))
    assert extra == (nodes - 1) / world * ((c + a) * 12 + c * 4)


def test_pack_and_unpack_move_the_replicated_pieces_and_nothing_else():
    tensor = torch.arange(10.0)
    runs = ((1, 2), (6, 3))
    packed = pack(tensor, runs)
    assert packed.tolist() == [1.0, 2.0, 6.0, 7.0, 8.0]
    target = torch.zeros(10)
    unpack(packed, target, runs)
    assert target.tolist() == [0, 1, 2, 0, 0, 0, 6, 7, 8, 0]
    assert pack(tensor, ()).numel() == 0


def test_a_reader_finds_every_owners_shard_of_a_replicated_param_on_its_own_node():
    """Simulated windows of 2 nodes x 2 ranks after the step's gather: every rank's reads of a replicated
    parameter, addressed as the runtime addresses them (owner on another node -> the replica slot of this
    node's rank with the owner's local rank), put the full parameter back together."""
    nodes, local_world = 2, 2
    world = nodes * local_world
    layouts = {}
    full = {1: torch.arange(11.0), 2: 100 + torch.arange(6.0), 3: 200 + torch.arange(5.0)}
    for rank in range(world):
        layout = _layout(nodes)
        layout.replicate({2, 3})
        layouts[rank] = layout
    windows = {rank: torch.full((layouts[rank].window_numel,), -1.0) for rank in range(world)}
    for owner in range(world):  # own blocks
        for key, slot in layouts[owner].slots.items():
            for o, start, count in owner_slices(slot.numel, slot.shard_numel, world):
                if o == owner:
                    windows[owner][slot.param_offset:slot.param_offset + count] = full[key][start:start + count]
    for rank in range(world):  # the gather: the other node's same-local-rank owner's replicated shards
        node, local = divmod(rank, local_world)
        for other in range(nodes):
            if other == node:
                continue
            source = other * local_world + local
            blocks = layouts[rank].blocks
            mine = pack(windows[source], blocks.trainable_runs + blocks.frozen_runs)
            offset, width = blocks.window_slot(ReplicaBlocks.slot_of(other, node))
            windows[rank][offset:offset + width] = mine
    for reader in range(world):
        node = reader // local_world
        for key in (2, 3):
            slot, out = layouts[reader].slots[key], torch.empty(full[key].numel())
            for owner, start, count in owner_slices(slot.numel, slot.shard_numel, world):
                owner_node, local = divmod(owner, local_world)
                if owner_node == node:
                    holder, offset = owner, slot.param_offset
                else:
                    holder = node * local_world + local
                    offset = layouts[reader].replica_param_offset(key, ReplicaBlocks.slot_of(owner_node, node))
                assert holder // local_world == node  # never leaves the node
                out[start:start + count] = windows[holder][offset:offset + count]
            assert torch.equal(out, full[key]), (reader, key)


def test_a_session_plan_groups_its_shards_into_layers_and_replicates_the_chosen_ones():
    trainable = [Shard(10, 8, 2, "blocks.0.weight"), Shard(12, 4, 1, "out.weight"), Shard(11, 4, 1, "blocks.0.bias")]
    frozen = [Shard(13, 4, 1, "blocks.1.weight")]
    plan = SessionPlan(trainable=trainable, frozen=frozen, compute_dtype=torch.float32, device="cpu",
                       norm_groups=1, timeout_s=5.0, cross_node="budget", replica_budget_gb=1.0)
    layers, members = plan.layers()
    assert layers == [("blocks.0", 12, 0), ("out.weight", 4, 0), ("blocks.1", 0, 4)]
    chosen = choose_replicated_layers(layers, 1e9, nodes=2, ranks_per_node=2)
    assert chosen == ("blocks.0", "out.weight", "blocks.1")
    from ds_odc.runtime.cross_node_plan import CrossNodeChoice

    layout = plan.layout(2, CrossNodeChoice("budget", "budget", ("blocks.0",), 0.0, ""))
    assert isinstance(layout, BudgetLayout) and layout.replicated == {10, 11}
    # blocks.0's two params are apart in the flat buffer (out.weight between them): two pieces, packed
    assert layout.blocks.trainable_runs == ((0, 2), (3, 1))
    assert type(plan.layout(2)) is not BudgetLayout and not plan.layout(2).replicated
