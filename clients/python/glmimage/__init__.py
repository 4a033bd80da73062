"""GLM-Image serving SDK: generated contracts (`glmimage.v1`) and clients. Needs only grpcio and protobuf."""
