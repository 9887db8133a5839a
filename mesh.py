"""Two device meshes over one world: a narrow one for dense weights, a wide one for experts.

Composer 2.5 shards non-expert weights with a narrow FSDP/HSDP layout (often within a node) and expert
weights, which hold most parameters and most Muon work, with a wider expert-sharding layout. Because the two
layouts are separate meshes over the same ranks, parallel dimensions that one shared mesh would have to
multiply can overlap instead: context parallelism (CP) lives in the dense mesh, expert parallelism (EP) in
the expert mesh, and CP=2 with EP=8 runs on 8 GPUs rather than 16. Megatron-Core calls this "parallel
folding" (arXiv 2504.14960); torchtitan's ParallelDims is the model for the checks.

    dense mesh   (dp_replicate, dp_shard, cp)   = torch.arange(world).view(dp_replicate, dp_shard, cp)
    expert mesh  (ep_replicate, ep_shard, ep)   = torch.arange(world).view(ep_replicate, ep_shard, ep)

The innermost dim holds neighbouring ranks (one node), so CP's K/V gathers and EP's all-to-alls stay local.
ep must divide dp_shard * cp, so an EP group never leaves one dense replica.

    python mesh.py --world 8 --cp 2 --ep 8        # print both meshes' groups; no processes launched
"""
import argparse
import os
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode


class LayoutError(ValueError):
    """An impossible layout; the message names every factor."""


@dataclass(frozen=True)
class Layout:
    world: int
    dp_replicate: int = 1
    dp_shard: int = 1
    cp: int = 1
    ep_replicate: int = 1
    ep_shard: int = 1
    ep: int = 1

    def dense_grid(self):  # [dp_replicate, dp_shard, cp] of global ranks
        return torch.arange(self.world).view(self.dp_replicate, self.dp_shard, self.cp)

    def expert_grid(self):  # [ep_replicate, ep_shard, ep] of global ranks
        return torch.arange(self.world).view(self.ep_replicate, self.ep_shard, self.ep)

    @property
    def dp(self):  # data-parallel degree: how many ways the global batch of sequences is split
        return self.dp_replicate * self.dp_shard

    def coords(self, rank):
        """rank -> (dp_rank, cp_rank): which slice of the batch and which chunk of the sequence it holds."""
        r, s, c = (self.dense_grid() == rank).nonzero()[0].tolist()
        return r * self.dp_shard + s, c

    def shared_mesh_world(self):
        """Fewest ranks one shared mesh needs for these degrees: with ep as a dim of its own beside cp, it is
        at least dp_replicate * cp * ep (dp_shard = 1). The seed's example: cp 2, ep 8 -> 16."""
        return self.dp_replicate * self.cp * self.ep


def make_layout(world, dp_replicate=1, cp=1, ep=1, ep_replicate=1, num_experts=None, seq_len=None,
                batch_size=None):
    """The shard degrees follow from the world size; raises LayoutError naming every factor."""
    for name, v in (("world size", world), ("dp_replicate", dp_replicate), ("cp", cp), ("ep", ep),
                    ("ep_replicate", ep_replicate)):
        if v < 1:
            raise LayoutError(f"{name} must be >= 1, got {v}")
    if world % (dp_replicate * cp):
        raise LayoutError(f"dp_replicate({dp_replicate}) * cp({cp}) = {dp_replicate * cp} does not divide "
                          f"world size {world}, so dp_shard = world / (dp_replicate * cp) is not an integer")
    dp_shard = world // (dp_replicate * cp)
    if world % (ep_replicate * ep):
        raise LayoutError(f"ep_replicate({ep_replicate}) * ep({ep}) = {ep_replicate * ep} does not divide "
                          f"world size {world}, so ep_shard = world / (ep_replicate * ep) is not an integer")
    ep_shard = world // (ep_replicate * ep)
    if (dp_shard * cp) % ep:
        raise LayoutError(f"ep({ep}) must divide dp_shard({dp_shard}) * cp({cp}) = {dp_shard * cp}: "
                          f"experts fold into one dense replica's ranks (world {world} = "
                          f"dp_replicate({dp_replicate}) * dp_shard({dp_shard}) * cp({cp}))")
    if num_experts is not None and num_experts % ep:
        raise LayoutError(f"num_experts({num_experts}) is not divisible by ep({ep})")
    if seq_len is not None and seq_len % cp:
        raise LayoutError(f"seq_len({seq_len}) is not divisible by cp({cp})")
    if batch_size is not None and batch_size % (dp_replicate * dp_shard):
        raise LayoutError(f"batch_size({batch_size}) is not divisible by dp_replicate({dp_replicate}) * "
                          f"dp_shard({dp_shard}) = {dp_replicate * dp_shard} data-parallel ranks")
    return Layout(world, dp_replicate, dp_shard, cp, ep_replicate, ep_shard, ep)


# -----------------------------------------------------------------------------
# Processes and meshes


def init_distributed(device_type=None, rollout_ranks=0):
    """-> (rank, local_rank, world_size, device, bridge). torchrun sets RANK/WORLD_SIZE/LOCAL_RANK; without
    them this is one process, no process group, and every collective is skipped. nccl/cuda with a GPU, else
    gloo/cpu.

    rollout_ranks K > 0 splits the launch's W ranks into two roles: the first W - K train, the last K only
    sample (train.py --rollout-ranks). Each role is a torch.distributed world of its own, its default process
    group (so the trainers' FSDP, EP and CP never wait on a sampler), and rank and world_size are those inside
    the role. bridge is a gloo group over all W ranks (global ranks) for the messages between the roles
    (grpo.Bridge); None without roles."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank, local_rank = int(os.environ.get("RANK", "0")), int(os.environ.get("LOCAL_RANK", "0"))
    device_type = device_type or ("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device("cuda", local_rank) if device_type == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend, bridge = "nccl" if device.type == "cuda" else "gloo", None
    if world_size > 1 and not dist.is_initialized():
        store, device_id = attempt_store(), device if device.type == "cuda" else None
        if rollout_ranks:
            trainers = world_size - rollout_ranks
            role, role_rank, role_size = (("train", rank, trainers) if rank < trainers else
                                          ("rollout", rank - trainers, rollout_ranks))
            bridge = dist.ProcessGroupGloo(dist.PrefixStore("bridge", store), rank, world_size)
            dist.init_process_group(backend, store=dist.PrefixStore(role, store), rank=role_rank,
                                    world_size=role_size, device_id=device_id)
            rank, world_size = role_rank, role_size
        else:
            dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                                    device_id=device_id)
    return rank, local_rank, world_size, device, bridge


def attempt_store():
    """torchrun's store (MASTER_ADDR, MASTER_PORT), its keys under this attempt's name. The launcher keeps one
    store across its restarts (--max-restarts) and the groups' keys keep their names: without the attempt's
    name a restarted rank finds a dead peer's address and hangs or fails joining (3 of 3 restarts here)."""
    store = next(dist.rendezvous("env://"))[0]
    return dist.PrefixStore(f"attempt{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)


def build_meshes(layout: Layout, device_type: str):
    """The dense and expert DeviceMesh (all None at world size 1), plus the meshes FSDP2 shards on: dense:
    (dp_replicate, dp_shard*cp) -- HSDP, CP ranks shard the dense weights too (torchtitan's dp_shard_cp);
    expert: (ep_replicate, ep_shard) -- HSDP across the ranks that hold the same experts. The 2-D dense mesh
    is built first from the explicit grid and unflattened into (dp_replicate, dp_shard, cp), so both views
    share one set of process groups."""
    if layout.world == 1:
        return None, None, None, None
    from torch.distributed.device_mesh import DeviceMesh
    L = layout
    dense_fsdp = DeviceMesh(device_type, L.dense_grid().view(L.dp_replicate, L.dp_shard * L.cp),
                            mesh_dim_names=("dp_replicate", "dp_shard_cp"))
    dense = dense_fsdp._unflatten("dp_shard_cp", (L.dp_shard, L.cp), ("dp_shard", "cp"))  # same grid, 3 dims
    expert = DeviceMesh(device_type, L.expert_grid(), mesh_dim_names=("ep_replicate", "ep_shard", "ep"))
    # an expert tensor's partial sums (a gradient norm) reduce over ep_shard and ep: with the two flattened
    # into one group DTensor reduces them in one all-reduce, not two in a row
    expert["ep_shard", "ep"]._flatten("ep_shard_ep")
    # without replicas, a 1-D FSDP mesh: a 2-D one would all-reduce every gradient over a group of one
    dense_fsdp = dense_fsdp if L.dp_replicate > 1 else dense_fsdp["dp_shard_cp"]
    expert_fsdp = expert["ep_replicate", "ep_shard"] if L.ep_replicate > 1 else expert["ep_shard"]
    return dense, expert, dense_fsdp, expert_fsdp


# -----------------------------------------------------------------------------
# Placing a model's weights on the meshes (torchtitan's parallelize, for any module tree)


def expert_shard_dim(layout: Layout, num_experts: int):
    """FSDP shards expert weights [E, out, in] over the ranks that hold the same experts: on dim 0 (whole
    experts) when each EP rank holds at least ep_shard of them, else on dim 1 (rows of every expert)."""
    return 0 if num_experts // layout.ep >= layout.ep_shard else 1


def parallelize(model, layout: Layout, meshes, bf16=False):
    """All of a Transformer's placement in one call, as torchtitan's parallelize_deepseekv3. Works on the meta
    device too (then `model.to_empty(device=...)` and initialize), so no rank ever holds more than its shards.
    - Context parallelism: every attention gets its CP group.
    - Experts (each MoE layer's .experts, stacked [E, out, in]): expert parallelism keeps experts
      [i*E/ep, (i+1)*E/ep) on rank i of the EP group (a DTensor on the ep mesh), then FSDP2 shards those
      over the expert FSDP mesh (HSDP with ep_replicate > 1) on expert_shard_dim.
    - FSDP2 units on the dense mesh, gathered one at a time: each block (its experts keep their own
      placement), the embedding, the norm with the output head; then the whole model.
    Duck-typed on model.layers (blocks with .attn), model.moe_layers(), model.embed, model.norm,
    model.lm_head and model.cfg.num_experts. meshes: build_meshes' four. bf16: FSDP gathers bf16 copies of
    the fp32 shards for compute and reduce-scatters fp32 gradients."""
    from torch import nn
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.tensor import Shard, distribute_tensor
    dense, expert, dense_fsdp, expert_fsdp = meshes
    for block in model.layers:
        block.attn.cp_group = dense["cp"].get_group() if layout.cp > 1 else None
    if layout.world == 1:
        return
    mp = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else
          MixedPrecisionPolicy())
    dim = expert_shard_dim(layout, model.cfg.num_experts)
    for m in [moe.experts for moe in model.moe_layers()]:
        if layout.ep > 1:
            for name, p in list(m.named_parameters()):
                m.register_parameter(name, nn.Parameter(distribute_tensor(p.data, expert["ep"], [Shard(0)],
                                                                          src_data_rank=None)))
        fully_shard(m, mesh=expert_fsdp, shard_placement_fn=lambda p: Shard(dim), mp_policy=mp)
        # Each expert's gradient already sums the tokens of the whole EP group (the all-to-all carries them
        # home), and FSDP averages over the world/ep ranks holding that expert: dividing by world, not by
        # world/ep, keeps it the mean over the global batch (the "EP factor" bug of other stacks).
        m.set_gradient_divide_factor(layout.world)
        if expert.device_type == "cpu" and layout.ep_shard > 1:
            # gloo lacks the PREMUL_SUM reduction a custom factor uses: sum, then divide. Not with a shard
            # group of one: FSDP (torch 2.13) would then divide twice, once without reducing.
            m.set_force_sum_reduction_for_comms(True)
    for unit in [*model.layers, model.embed, [model.norm, model.lm_head]]:
        fully_shard(unit, mesh=dense_fsdp, mp_policy=mp)
    fully_shard(model, mesh=dense_fsdp, mp_policy=mp)


class CommCounter(TorchDispatchMode):
    """Counts, on this rank, the calls and bytes of each kind of collective that passes the dispatcher: c10d
    ops (FSDP2's all-gathers and reduce-scatters), functional collectives (EP all-to-all, CP gathers, DTensor
    redistributes) and their backward passes. Bytes are the full buffer of the collective: the gathered output
    of an all-gather, the unreduced input of a reduce-scatter, what this rank sends in an all-to-all, the
    tensor of an all-reduce (a ring moves (W-1)/W of that per rank).

        with CommCounter() as comm: ...one training step...
        comm.bytes  # {"all_gather": ..., "reduce_scatter": ..., "all_to_all": ..., "all_reduce": ...}"""

    KINDS = (("reduce_scatter", "reduce_scatter"), ("all_to_all", "all_to_all"), ("alltoall", "all_to_all"),
             ("gather", "all_gather"), ("allreduce", "all_reduce"), ("all_reduce", "all_reduce"),
             ("broadcast", "broadcast"))

    def __init__(self):
        super().__init__()
        self.bytes, self.calls = {}, {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._overloadpacket.__name__
        kind = next((k for key, k in self.KINDS if key in name), None)
        if func.namespace in ("c10d", "_c10d_functional") and kind is not None:
            def size(a):  # bytes of a tensor or of the tensors in a (nested) list
                if isinstance(a, torch.Tensor):
                    return a.numel() * a.element_size()
                return sum(size(x) for x in a) if isinstance(a, (list, tuple)) else 0
            n = max(size(a) for a in args)  # the larger side: output of a gather, input of a reduce-scatter
            if func.namespace == "_c10d_functional" and kind == "all_gather":
                n *= args[1]  # functional all-gather gets only the shard, and the group size
            self.bytes[kind] = self.bytes.get(kind, 0) + n
            self.calls[kind] = self.calls.get(kind, 0) + 1
        return func(*args, **(kwargs or {}))


def groups_of(grid, dim, rank):
    """The ranks sharing every coordinate of `rank` except along `dim` of the grid."""
    moved = grid.movedim(dim, -1).reshape(-1, grid.size(dim))
    return moved[(moved == rank).any(-1)][0].tolist()


def _short(ranks):
    return (str(ranks) if len(ranks) <= 8 else
            f"[{ranks[0]}, {ranks[1]}, ..., {ranks[-1]}] ({len(ranks)} ranks)")


def describe(layout: Layout, ranks=None):
    """One line per rank: its groups along each dim of both meshes (pure arithmetic on the grids)."""
    dense, expert = layout.dense_grid(), layout.expert_grid()
    lines = []
    for rank in ranks if ranks is not None else range(layout.world):
        d = " ".join(f"{n}={_short(groups_of(dense, i, rank))}"
                     for i, n in enumerate(("dp_replicate", "dp_shard", "cp")))
        e = " ".join(f"{n}={_short(groups_of(expert, i, rank))}"
                     for i, n in enumerate(("ep_replicate", "ep_shard", "ep")))
        lines.append(f"rank {rank:4d} | dense {d} | expert {e}")
    return lines


# -----------------------------------------------------------------------------
# Appendix: running and measuring it

if __name__ == "__main__":
    p = argparse.ArgumentParser(
        description="Print the dense and expert meshes of a layout (no processes launched).")
    p.add_argument("--world", type=int, default=8, help="total ranks (GPUs)")
    p.add_argument("--dp-replicate", type=int, default=1,
                   help="dense replicas (HSDP); dp_shard = world/(dp_replicate*cp)")
    p.add_argument("--cp", type=int, default=1, help="context-parallel degree (sequence split)")
    p.add_argument("--ep", type=int, default=1, help="expert-parallel degree (experts split)")
    p.add_argument("--ep-replicate", type=int, default=1,
                   help="expert replicas; ep_shard = world/(ep_replicate*ep)")
    p.add_argument("--num-experts", type=int, default=None, help="checked for divisibility by ep")
    p.add_argument("--show", type=int, default=16, help="print the groups of the first N ranks (0: all)")
    a = p.parse_args()
    try:
        L = make_layout(a.world, a.dp_replicate, a.cp, a.ep, a.ep_replicate, a.num_experts)
    except LayoutError as e:
        sys.exit(f"error: {e}")
    print(f"world {L.world}: dense mesh (dp_replicate={L.dp_replicate}, dp_shard={L.dp_shard}, cp={L.cp}), "
          f"expert mesh (ep_replicate={L.ep_replicate}, ep_shard={L.ep_shard}, ep={L.ep})")
    shown = range(L.world if a.show == 0 else min(a.show, L.world))
    print("\n".join(describe(L, shown)))
    if len(shown) < L.world:
        print(f"... {L.world - len(shown)} more ranks (--show 0 prints all)")
    print("one shared mesh, with ep a dim of its own beside cp, needs at least "
          f"dp_replicate({L.dp_replicate}) * cp({L.cp}) * ep({L.ep}) = {L.shared_mesh_world()} ranks; "
          f"the two meshes run these degrees on {L.world}")
