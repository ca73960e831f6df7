"""embedcore for TensorFlow (installed as embedcore.adapters.tf)."""
