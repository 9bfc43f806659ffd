"""The front end, in the server's own process: the gRPC service (grpc_service.py), the process's life
(lifecycle.py, loading.py) and the serving state both front ends read (state.py), request conversion and
validation (validation.py), auth and TLS (auth.py), settings (config.py), the command line (cli.py),
Prometheus metrics (metrics.py) and the client (client.py). It talks to the scheduling layer only."""
