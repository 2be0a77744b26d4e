"""jaxpaged.server: the OpenAI-compatible HTTP server (`python -m jaxpaged.server`)."""
