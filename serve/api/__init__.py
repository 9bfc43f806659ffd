"""The front end, in the server's own process: the gRPC service (grpc_service.py), the HTTP APIs (openai/:
the OpenAI-compatible API and the app that serves both; anthropic/: Anthropic's Messages API), the process's
life (lifecycle.py, loading.py) and the serving state both front ends read (state.py), request conversion and
validation (validation.py), tool calls (tool_calls.py, tool_formats.py, reply_blocks.py), auth and TLS
(auth.py), settings (config.py), the command line (cli.py), Prometheus metrics (metrics/) and the client
(client.py). It talks to the scheduling layer only."""
