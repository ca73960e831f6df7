"""Sharded tables over N ranks.

``Embedding(feature_config, optimizer, world=comm, sharding=...)`` splits
its tables over the ranks of `comm` (table-, row- or column-wise, or an
``"auto"`` plan) and looks up each rank's part of the batch with one
all-to-all algorithm. Communicators:

- ``run_local(N, fn)``: N ranks as threads of this process (tests, and
  serving a sharded checkpoint in one process);
- ``init("mpi")``: CPU processes under ``mpiexec -n N`` (mpi4py);
- ``embedcore.adapters.torch.distributed.init()``: a ``torch.distributed``
  process group (gloo or NCCL), for ``torchrun`` users;
- ``init("nccl")``: GPU ranks, in the CUDA build only.

``embedcore.save`` / ``embedcore.load`` of a sharded Embedding are
collective: every rank writes its own shards and reads only the blocks it
owns, and a checkpoint saved on N ranks with any plan restores on M ranks
with any plan. ``reshard`` (and ``embedcore reshard``) rewrites a checkpoint
for another world size offline.
"""
from ._comm import CollectiveMismatchError, Comm, RankFailedError, init, run_local
from ._plan import KINDS, Shard, ShardingPlan, TableSharding, make_plan
from ._embedding import ShardedEmbedding
from ._checkpoint import reshard

__all__ = ["CollectiveMismatchError", "Comm", "KINDS", "RankFailedError", "Shard", "ShardedEmbedding", "ShardingPlan", "TableSharding",
           "init", "make_plan", "reshard", "run_local"]
