"""The wire helpers every process shares, client and server alike: image formats, the size parser, channel
building and keepalive. They import only grpc, protobuf, the stdlib and ``glmimage.v1``, never the SDK."""
