"""Serving the trained model: the `serve` spec section, vLLM's server, the serving acceptance check."""
