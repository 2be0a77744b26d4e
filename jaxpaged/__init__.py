"""jaxpaged: vLLM-style serving in JAX."""
