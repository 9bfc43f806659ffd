"""Anthropic's Messages API, served by the same HTTP application as the OpenAI-compatible one
(serve/api/openai/app.py) and through the same skeleton: its wire objects (protocol), a body → scheduler
translation (translate) and its renderer (messages)."""
