import base64

import pytest
from pydantic import ValidationError

from services.sandbox.executor import to_response
from services.sandbox.protocol import RunOutcome
from services.sandbox.runner import CappedBuffer
from services.sandbox.schemas import RunCodeRequest, check_relative_path


def test_capped_buffer_keeps_head_and_tail_and_marks_truncation():
    buf = CappedBuffer(10)
    buf.feed(b"0123456789ABCDEFGHIJ")
    out = buf.render()
    assert out.startswith(b"01234") and out.endswith(b"FGHIJ")
    assert b"truncated: 10 bytes omitted" in out
    small = CappedBuffer(100)
    small.feed(b"abc")
    small.feed(b"def")
    assert small.render() == b"abcdef" and small.dropped == 0


def test_capped_buffer_many_small_chunks_equivalent_to_one():
    a, b = CappedBuffer(64), CappedBuffer(64)
    data = bytes(range(256)) * 10
    a.feed(data)
    for i in range(0, len(data), 7):
        b.feed(data[i:i + 7])
    assert a.render() == b.render()


@pytest.mark.parametrize("path", ["/etc/passwd", "../x", "a/../../x", "", ".", "a\x00b"])
def test_paths_escaping_the_workdir_are_rejected(path):
    with pytest.raises(ValueError):
        check_relative_path(path)


def test_relative_paths_are_normalised():
    assert check_relative_path("a/./b.txt") == "a/b.txt"


def test_language_aliases_and_rejection():
    assert RunCodeRequest(code="1", language="python3").language == "python"
    with pytest.raises(ValidationError) as err:
        RunCodeRequest(code="1", language="cpp")
    assert err.value.errors()[0]["loc"] == ("language",)


def test_bad_base64_names_the_file():
    with pytest.raises(ValidationError, match="data.bin"):
        RunCodeRequest(code="1", files={"data.bin": "!!notbase64!!"})
    req = RunCodeRequest(code="1", files={"d/x.txt": base64.b64encode(b"hi").decode()})
    assert req.decoded_files() == {"d/x.txt": b"hi"}


def test_status_mapping_matches_sandboxfusion():
    ok = to_response(RunOutcome(return_code=0, stdout=b"hi\n", execution_time=0.1))
    assert ok.status == "Success" and ok.run_result.status == "Finished" and ok.run_result.stdout == "hi\n"
    failed = to_response(RunOutcome(return_code=1, stderr=b"boom"))
    assert failed.status == "Failed" and failed.run_result.status == "Finished"
    assert failed.run_result.return_code == 1
    tle = to_response(RunOutcome(timed_out=True, execution_time=2.0))
    assert tle.status == "Failed" and tle.run_result.status == "TimeLimitExceeded"
    err = to_response(RunOutcome(ok=False, error="zygote gone"))
    assert err.status == "SandboxError" and err.message == "zygote gone" and err.run_result is None
    files = to_response(RunOutcome(return_code=0, files={"o.txt": b"\x00\x01"}))
    assert base64.b64decode(files.files["o.txt"]) == b"\x00\x01"
