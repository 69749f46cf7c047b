"""The HTTP server: the OpenAI API (completions, chat, embeddings, tokenize), the Responses API, Ollama's API and the
KV page, over one engine client."""
