"""Stubs generated from proto/turbokv/v1/turbokv.proto by protoc and grpc_python_plugin (tests/stubs_test.py keeps them current)."""
