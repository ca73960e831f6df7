"""embedcore for PyTorch (installed as ``embedcore.adapters.torch``).

Modules over embedcore tables, in the shapes PyTorch users know:

- ``EmbeddingBag`` / ``Embedding``: drop-ins for ``torch.nn.EmbeddingBag`` /
  ``torch.nn.Embedding``;
- ``EmbeddingBagCollection`` / ``EmbeddingCollection``: several tables and
  features, shaped like TorchRec's (dicts of features, or TorchRec's
  ``KeyedJaggedTensor`` when TorchRec is installed);
- training fused (``optimizer=embedcore.optimizers.Adam(...)``: the update
  runs inside ``backward()``) or through PyTorch's sparse optimizers;
- ``state_dict()`` weights that view the engine's memory, the fused
  optimizers' slots through ``optimizer_state_dict()`` / ``fused_optimizer``,
  and ``ec.save`` / ``ec.load`` / ``ec.Saver`` on every module;
- lookups registered as ``torch.library`` custom ops (``embedcore::lookup``,
  ``embedcore::lookup_backward``), so ``torch.compile(fullgraph=True)``
  runs models that use them;
- tables sharded over the ranks of a ``torch.distributed`` process group
  (``distributed.init()`` under ``torchrun``, then
  ``EmbeddingBagCollection(..., world=comm, sharding="row_wise")``);
- ``convert_state_dict``: the tables of a saved state dict (TorchRec's
  collections' included) as an embedcore checkpoint, to serve without PyTorch;
- ``ServedEmbeddingBagCollection`` / ``ServedEmbeddingCollection``: a
  checkpoint served memory-mapped (any stored dtype, 8-bit rows included) in
  TorchRec's inference shape, KeyedJaggedTensor in, KeyedTensor out.

Importing this package imports PyTorch; ``import embedcore`` does not.
"""
try:
    import torch as _torch  # noqa: F401  (only to fail early with a clear message)
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError("embedcore.adapters.torch needs PyTorch: pip install torch") from e

from ._convert import convert_state_dict
from ._collection import EmbeddingBagCollection, EmbeddingBagConfig, EmbeddingCollection, EmbeddingConfig
from ._modules import Embedding, EmbeddingBag, tables_of
from ._optim import FusedOptimizer
from ._serving import ServedEmbeddingBagCollection, ServedEmbeddingCollection
from ._sharded import ShardedEmbeddingBagCollection, ShardedEmbeddingCollection
from . import distributed

__all__ = [
    "Embedding",
    "EmbeddingBag",
    "EmbeddingBagCollection",
    "EmbeddingBagConfig",
    "EmbeddingCollection",
    "EmbeddingConfig",
    "FusedOptimizer",
    "ServedEmbeddingBagCollection",
    "ServedEmbeddingCollection",
    "ShardedEmbeddingBagCollection",
    "ShardedEmbeddingCollection",
    "convert_state_dict",
    "distributed",
    "tables_of",
]
