"""Generated protobuf and gRPC code for tokenmesh.v1."""
