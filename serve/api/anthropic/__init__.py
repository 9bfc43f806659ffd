"""Anthropic's Messages API, over the shared HTTP parts (serve/api/http/) and through the same skeleton as
the OpenAI-compatible one, which it does not import: its wire objects (protocol), a body → scheduler
translation (translate), its renderer (messages) and the router of its routes (routes)."""
