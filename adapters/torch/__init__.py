"""embedcore for PyTorch (installed as embedcore.adapters.torch)."""
