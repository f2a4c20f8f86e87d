"""Run by tests/unit/test_testbed.py on the testbed, one rank per namespace: an MPI Allreduce and a
gloo all_reduce across the namespaces, and where each rank found itself. Rank 0 prints one JSON line: a record per rank.
"""
import json
import os
import socket

import numpy as np
from mpi4py import MPI


def tx_bytes(iface):
    with open(f"/sys/class/net/{iface}/statistics/tx_bytes") as f:
        return int(f.read())


def main():
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    iface = os.environ["EXDYNA_TESTBED_IFACE"]
    # The address of this namespace's interface: the rank must sit in its own namespace.
    addrs = os.popen(f"ip -o -4 addr show dev {iface}").read().split()
    addr = addrs[addrs.index("inet") + 1].split("/")[0] if "inet" in addrs else None
    n = 1 << 17                                      # 1 MiB of float64
    x = np.arange(n, dtype=np.float64) * (rank + 1)
    mpi_sum = np.empty_like(x)
    tx0 = tx_bytes(iface)
    comm.Allreduce(x, mpi_sum, op=MPI.SUM)
    out = {"rank": rank, "size": size, "addr": addr, "hostname": socket.gethostname(),
           "mpi_ok": bool(np.array_equal(mpi_sum, np.arange(n) * size * (size + 1) / 2)),
           "mpi_tx_bytes": tx_bytes(iface) - tx0, "payload_bytes": x.nbytes}
    if os.environ.get("PROBE_GLOO") == "1":
        import torch
        import torch.distributed as dist

        dist.init_process_group("gloo", init_method=f"tcp://{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}",
                                rank=rank, world_size=size)
        t = torch.arange(n, dtype=torch.float64) * (rank + 1)
        tx0 = tx_bytes(iface)
        dist.all_reduce(t)
        out["gloo_tx_bytes"] = tx_bytes(iface) - tx0
        out["gloo_ok"] = bool(torch.equal(t, torch.arange(n, dtype=torch.float64) * size * (size + 1) / 2))
        dist.destroy_process_group()
    every = comm.gather(out)                         # one line from rank 0: ranks' prints interleave
    if rank == 0:
        print(json.dumps(every), flush=True)


if __name__ == "__main__":
    main()
