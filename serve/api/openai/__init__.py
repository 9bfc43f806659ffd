"""The OpenAI-compatible HTTP API (vLLM's routes where OpenAI has none), over the shared HTTP parts
(serve/api/http/): wire objects (protocol), each route's body → scheduler translation (translate_*.py;
refusals; structured_output), the logprobs formats (logprobs), each generation route's renderer (completions,
chat, responses) and the router of its routes (routes)."""
