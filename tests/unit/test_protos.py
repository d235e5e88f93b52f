"""The public contract: generated code matches the protos, and the schema rules hold."""

from __future__ import annotations

import subprocess
import sys

from google.protobuf.descriptor import FieldDescriptor

from tests.support import ROOT
from tokenmesh.v1 import inference_pb2, llm_pb2, ops_pb2, rerank_pb2, token_pb2

MODULES = (inference_pb2, llm_pb2, ops_pb2, rerank_pb2, token_pb2)


def all_fields():
    for module in MODULES:
        for message in module.DESCRIPTOR.message_types_by_name.values():
            for field in message.fields:
                yield message.full_name, field


def test_committed_generated_code_is_up_to_date() -> None:
    result = subprocess.run(
        [sys.executable, "scripts/gen_protos.py", "--check"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_time_fields_are_int64_unix_times() -> None:
    for message, field in all_fields():
        if "unix" in field.name or field.name.endswith(("_at", "_time", "timestamp")):
            assert field.type == FieldDescriptor.TYPE_INT64, f"{message}.{field.name}"
            assert "unix" in field.name, f"{message}.{field.name} must say its epoch and unit"


def test_field_names_are_snake_case() -> None:
    for message, field in all_fields():
        assert field.name == field.name.lower(), f"{message}.{field.name}"


def test_public_api_has_the_four_call_shapes() -> None:
    service = llm_pb2.DESCRIPTOR.services_by_name["LLMService"]
    shapes = {
        method.name: (method.client_streaming, method.server_streaming)
        for method in service.methods
    }
    assert shapes == {
        "GetAnswer": (False, False),
        "Generate": (False, True),
        "Summarize": (True, False),
        "Chat": (True, True),
    }
    request = llm_pb2.GenerateRequest.DESCRIPTOR.fields_by_name
    assert {"prompt", "max_tokens", "temperature", "documents", "top_k_documents"} <= set(request)
    token = token_pb2.Token.DESCRIPTOR.fields_by_name
    assert token["text"].type == FieldDescriptor.TYPE_STRING
    assert token["index"].type == FieldDescriptor.TYPE_INT32


def test_package_is_versioned() -> None:
    for module in MODULES:
        assert module.DESCRIPTOR.package == "tokenmesh.v1"
