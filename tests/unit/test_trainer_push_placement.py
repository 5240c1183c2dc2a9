"""Where the trainer encodes a weight delta (``weight_encode_where``) and what it hands the pusher."""

from __future__ import annotations

import pytest
import torch

from services.trainer.fsdp import encode_on_device, full_state_dict
from services.trainer.run_config import RunConfig

CUDA = torch.device("cuda", 0)
CPU = torch.device("cpu")


@pytest.mark.parametrize(("where", "device", "world", "transport", "expected"), [
    ("auto", CUDA, 1, "grpc", True),    # one CUDA rank: the master is already on that GPU
    ("auto", CUDA, 8, "grpc", False),   # sharded: the whole model would be gathered onto one GPU
    ("auto", CPU, 1, "grpc", False),    # CPU trainer: numpy on the host is the faster encoder
    ("device", CPU, 4, "grpc", True),   # an explicit choice is kept
    ("host", CUDA, 1, "grpc", False),
    ("device", CUDA, 1, "shm", False),  # shared-memory pushes copy host tensors and encode nothing
    ("auto", CUDA, 1, "shm", False),
])
def test_encode_where_decision(where: str, device: torch.device, world: int, transport: str,
                               expected: bool) -> None:
    assert encode_on_device(where, device, world, transport) is expected


def test_encode_where_is_validated() -> None:
    assert RunConfig(dataset="d.parquet").weight_encode_where == "auto"
    with pytest.raises(ValueError, match="weight_encode_where"):
        RunConfig(dataset="d.parquet", weight_encode_where="gpu")  # type: ignore[arg-type]


@pytest.mark.parametrize("on_device", [False, True])
def test_full_state_dict_is_a_snapshot(on_device: bool) -> None:
    """The pusher compares the weights it was handed with the next ones: an optimizer step after the
    snapshot must not change it, wherever it lives."""
    model = torch.nn.Linear(4, 3)
    snap = full_state_dict(model, on_device=on_device)
    before = {k: v.clone() for k, v in snap.items()}
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    for name, value in snap.items():
        assert value.device == dict(model.named_parameters())[name].device
        assert torch.equal(value, before[name])
        assert value.data_ptr() != dict(model.named_parameters())[name].data_ptr()
