"""Example models and data: MiniLM sentence embeddings and a small CNN on noisy digits."""
