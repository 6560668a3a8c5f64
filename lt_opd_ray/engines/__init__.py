"""Inference engines behind the rollout and teacher interfaces (vLLM)."""
