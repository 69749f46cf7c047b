"""OpenAI's Responses API on the server's app: /v1/responses, its typed stream events and its store."""
