"""Framework adapters: ``embedcore.adapters.torch`` and ``embedcore.adapters.tf``.

Each imports its framework only when imported itself, so ``import embedcore``
needs neither PyTorch nor TensorFlow.
"""
