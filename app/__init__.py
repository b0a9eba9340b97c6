"""The HTTP side of minserve: an OpenAI-compatible API on Ray Serve.

Modules: protocol (request/response models), errors (the one error shape), ingress (FastAPI routes),
engine_client (the ingress's streams to the engine), engine_deployment (one engine core process per
replica), streaming (its stream items and their pacing), sse (streaming and non-streaming response
assembly), metrics (Ray Serve metrics), builder (the `serve run` entry point). Nothing here is
imported by engine/.
"""
