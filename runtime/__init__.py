"""The torch-free runtime shared by every process we serve: the AR and denoiser servers, the gateway and the REST
front.

What lives here once: domain errors (``errors``) and their map to gRPC and HTTP (``status``), the status details
that carry them (``details``); the limits model (``limits``) and the admission checks over it (``admission``);
logs with request ids (``logs``), Prometheus exposition (``metrics``), bearer credentials (``auth``), TLS
(``tls``), keepalive (``keepalive``), deadlines, intake, the executor and the ``die_with_parent`` trampoline; and
the gRPC server builder (``server``: health, reflection, the error interceptor, graceful drain). It imports only
the protocol (``glmimage.v1``, ``glmimage.wire``), never torch or a model library (tests/test_layers.py checks it).
"""
