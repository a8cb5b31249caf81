"""The gateway actor: the OpenAI-compatible HTTP server."""
