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
from ._export import export_mode
from ._native import NativeOpError
from ._saver import Saver
from ._serving import EmbeddingForServing, TableHandle


def __getattr__(name):
    if name == "Embedding":  # the Keras layer: imports Keras only when asked for
        from ._keras import Embedding

        return Embedding
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "Embedding",
    "EmbeddingForServing",
    "NativeOpError",
    "Saver",
    "TFCheckpoint",
    "TableHandle",
    "convert_tf_checkpoint",
    "export_mode",
    "load_tf_checkpoint",
    "optimizer_from_tf",
]
