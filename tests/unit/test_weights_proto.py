"""The committed gRPC code in services/proto_gen/ is what scripts/gen_proto.sh makes of proto/retool.proto."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
GENERATED = ("retool_pb2.py", "retool_pb2.pyi", "retool_pb2_grpc.py")


def test_generated_code_is_up_to_date(tmp_path):
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "gen_proto.sh"), str(tmp_path)],
                          env={"PYTHON": sys.executable, "PATH": "/usr/bin:/bin"},
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    for name in GENERATED:
        fresh = (tmp_path / "services" / "proto_gen" / name).read_text()
        committed = (ROOT / "services" / "proto_gen" / name).read_text()
        assert fresh == committed, f"services/proto_gen/{name} is stale: run scripts/gen_proto.sh"


def test_generated_module_imports_as_a_package():
    from services.proto_gen import retool_pb2, retool_pb2_grpc

    assert retool_pb2.WeightChunk.DESCRIPTOR.full_name == "retool.v1.WeightChunk"
    assert hasattr(retool_pb2_grpc, "WeightServiceStub")
