"""The Anthropic Messages and OpenAI Responses APIs, translated at the edge onto the chat path."""
