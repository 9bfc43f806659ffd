"""The OpenAI-compatible HTTP API: wire objects (protocol), the body → scheduler translation (translate,
structured_output), token logprobs (logprobs), the Responses route (responses) and the FastAPI app with its
front door and uvicorn server (app)."""
