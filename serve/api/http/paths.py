"""The HTTP API's paths and the names its front door gives a request's id."""

from __future__ import annotations

COMPLETIONS, CHAT, MODELS, HEALTH = "/v1/completions", "/v1/chat/completions", "/v1/models", "/health"
TOKENIZE, DETOKENIZE = "/tokenize", "/detokenize"  # vLLM's and llama-server's paths
RESPONSES = "/v1/responses"
LOAD_LORA, UNLOAD_LORA = "/v1/load_lora_adapter", "/v1/unload_lora_adapter"  # vLLM's, with a flag
MESSAGES, COUNT_TOKENS = "/v1/messages", "/v1/messages/count_tokens"  # Anthropic's Messages API
# The routes whose errors are in Anthropic's shape.
ANTHROPIC_ROUTES = frozenset({MESSAGES, COUNT_TOKENS})
# The `rpc` label values (health is not counted).
ROUTES = frozenset(
    {COMPLETIONS, CHAT, MODELS, TOKENIZE, DETOKENIZE, RESPONSES, LOAD_LORA, UNLOAD_LORA, *ANTHROPIC_ROUTES}
)
REQUEST_ID_HEADER = "x-request-id"
REQUEST_ID_KEY = "textgen.request_id"
