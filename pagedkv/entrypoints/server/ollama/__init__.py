"""Ollama's API on the server's app: /api/chat, /api/generate, /api/embed and the model routes, in Ollama's shapes."""
