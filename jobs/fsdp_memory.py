"""Memory per rank of sharded training: FSDP2 with its dense reduce-scatter, with a bf16 one, and with
ExDyna's sparse one (``ShardedExchange``), on the e2e LM (jobs/models.py ``GPT``), AdamW.

Each mode builds the model, applies ``fully_shard`` to every block and the root, trains a few
steps with clipping, and then sums on each rank the bytes of what it holds: its parameters' local
shards, its gradients' local shards, AdamW's state and the exchange's residuals (tensors'
``to_local()`` bytes, as allocated, padding excluded). Every mode runs in the same launch. Run::

    timeout 900 mpiexec -n 4 python -m mpi4py jobs/fsdp_memory.py --out results/fsdp_memory/DATE

writes ``memory.json`` (one row per mode and rank) and prints the table of the largest rank.
"""
import platform

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

import common
import models
from e2e_train import init_torch_distributed
from exdyna_mpi.adapters.torch_fsdp import ShardedExchange

MODES = ("fsdp", "fsdp-bf16", "exdyna")


def _local_bytes(t):
    t = t.to_local() if hasattr(t, "to_local") else t
    return t.numel() * t.element_size()


def measure(mode, args, rank):
    torch.manual_seed(args.seed)
    model = models.GPT(d_model=args.d_model, layers=args.layers, heads=args.heads, context=args.context)
    numel = sum(p.numel() for p in model.parameters())
    mp = MixedPrecisionPolicy(reduce_dtype=torch.bfloat16) if mode == "fsdp-bf16" else MixedPrecisionPolicy()
    for block in model.blocks:
        fully_shard(block, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    sharded = ShardedExchange(model, args.density) if mode == "exdyna" else None
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    g = torch.Generator().manual_seed(1000 + rank)
    for _ in range(args.steps):
        x = torch.randint(0, 256, (args.batch, args.context + 1), generator=g)
        logits = model(x[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 256), x[:, 1:].reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if _ < args.steps - 1:
            opt.zero_grad(set_to_none=True)
    params = sum(_local_bytes(p) for p in model.parameters())
    grads = sum(_local_bytes(p.grad) for p in model.parameters() if p.grad is not None)
    state = sum(_local_bytes(v) for s in opt.state.values() for v in s.values() if torch.is_tensor(v))
    residual = 0
    if sharded is not None:
        residual = sum(int(np.asarray(rs.sparsifier.residual).nbytes) for rs in sharded.units.values())
    return {"mode": mode, "rank": rank, "numel": numel, "params": params, "grads": grads, "optimizer": state,
            "residual": residual, "grads_state_residual": grads + state + residual}


def main():
    ap = common.parser(__doc__, density=0.05, steps=2, seed=0, out="out/fsdp_memory")
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=2)
    ap.add_argument("--context", type=int, default=64)
    ap.add_argument("--batch", type=int, default=8)
    args = ap.parse_args()
    comm, rank, p = common.world(args)
    common.set_torch_threads(comm)
    init_torch_distributed(comm)
    rows = []
    for mode in MODES:
        rows.extend(comm.allgather(measure(mode, args, rank)))
    dist.destroy_process_group()
    if rank:
        return
    base = max(r["grads_state_residual"] for r in rows if r["mode"] == "fsdp")
    table = []
    for mode in MODES:
        top = max((r for r in rows if r["mode"] == mode), key=lambda r: r["grads_state_residual"])
        n = top["numel"]
        table.append([mode] + [f"{top[k] / n:.2f}" for k in ("params", "grads", "optimizer", "residual",
                                                              "grads_state_residual")]
                     + [f"{top['grads_state_residual'] / base:.2f}x"])
    print(common.markdown_table(["mode", "params B/param", "grads", "AdamW state", "residual",
                                 "grads+state+residual", "vs fsdp"], table))
    common.write_json(f"{args.out}/memory.json", {
        "command": common.command(), "ranks": p, "machine": platform.processor() or platform.machine(),
        "cpu": common.cpu_model(), "torch": torch.__version__, "density": args.density,
        "model": {"d_model": args.d_model, "layers": args.layers, "heads": args.heads, "context": args.context},
        "rows": rows})


if __name__ == "__main__":
    common.abort_on_exception(__import__("mpi4py").MPI.COMM_WORLD)
    main()
