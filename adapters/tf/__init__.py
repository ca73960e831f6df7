"""embedcore for TensorFlow (installed as ``embedcore.adapters.tf``).

A drop-in for ``tf.tpu.experimental.embedding.TPUEmbeddingForServing`` whose
tables live in embedcore's engine, a Keras layer that trains them with
``model.fit``, SOK's ``Saver`` calls, and readers of TensorFlow's TPU
embedding checkpoints. This package imports TensorFlow; ``import embedcore``
does not. See ``docs/tensorflow.md``.
"""
try:
    import tensorflow as _tf  # noqa: F401
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError("embedcore.adapters.tf needs TensorFlow: pip install tensorflow-cpu (or tensorflow)") from e

from ._checkpoint import TFCheckpoint, convert_tf_checkpoint, load_tf_checkpoint
from ._config import optimizer_from_tf
from ._keras import Embedding
from ._saver import Saver
from ._serving import EmbeddingForServing, TableHandle

__all__ = [
    "Embedding",
    "EmbeddingForServing",
    "Saver",
    "TFCheckpoint",
    "TableHandle",
    "convert_tf_checkpoint",
    "load_tf_checkpoint",
    "optimizer_from_tf",
]
