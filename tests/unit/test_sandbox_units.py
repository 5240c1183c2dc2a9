import base64

import pytest
from pydantic import ValidationError

from services.sandbox.capture import CappedBuffer, decode_output
from services.sandbox.config import SandboxConfig
from services.sandbox.executor import to_response
from services.sandbox.limits import queue_wait_s, resolve_limits
from services.sandbox.protocol import RunOutcome
from services.transport.sandbox.schemas import RunCodeRequest, check_relative_path


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


def test_capped_buffer_never_cuts_a_utf8_character():
    for cap in range(8, 40):
        for text in ("é" * 50, "数学" * 30, "a€𝔸" * 20):
            buf = CappedBuffer(cap)
            buf.feed(text.encode())
            out = buf.render().decode()  # strict: raises if a character was cut
            head, tail = out.split("\n...[output truncated: ")[0], out.rsplit("omitted]...\n", 1)[1]
            assert text.startswith(head) and text.endswith(tail)
            omitted = int(out.split("truncated: ")[1].split(" ")[0])
            assert len(head.encode()) + len(tail.encode()) + omitted == len(text.encode())


def test_invalid_utf8_is_marked_like_sandboxfusion():
    assert decode_output("héllo".encode()) == "héllo"
    assert decode_output(b"ok\xff") == ("[DecodeError] 'utf-8' codec can't decode byte 0xff in position 2: "
                                        "invalid start byte")


def test_over_limit_timeout_and_memory_are_clamped_with_a_note():
    cfg = SandboxConfig(max_run_timeout_s=60, max_memory_mb=4096)
    limits = resolve_limits(RunCodeRequest(code="1", run_timeout=100, memory_limit_MB=8192), cfg)
    assert (limits.timeout_s, limits.memory_mb) == (60, 4096)
    assert any("run_timeout 100" in n for n in limits.notes) and any("memory_limit_MB 8192" in n
                                                                       for n in limits.notes)
    plain = resolve_limits(RunCodeRequest(code="1", run_timeout=5, memory_limit_MB=-1), cfg)
    assert (plain.timeout_s, plain.memory_mb, plain.stack_mb, plain.notes) == (5, 1024, 1024, ())
    capped_stack = resolve_limits(RunCodeRequest(code="1", memory_limit_MB=2048),
                                  SandboxConfig(stack_limit_mb=256))
    assert capped_stack.stack_mb == 256


def test_queue_wait_stays_within_verls_read_timeout():
    cfg = SandboxConfig(queue_timeout_s=30)
    # verl reads for compile_timeout + run_timeout + 10 s; waiting + running must fit in that
    for compile_timeout, run_timeout in ((30, 30), (5, 5), (0, 10)):
        wait = queue_wait_s(RunCodeRequest(code="1", compile_timeout=compile_timeout), cfg)
        assert wait + run_timeout + 1 < compile_timeout + run_timeout + 10


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
    killed = to_response(RunOutcome(return_code=-9))
    assert killed.status == "Failed" and killed.run_result.status == "Finished"
    assert killed.run_result.return_code == -9


def test_message_lists_adjustments_and_skipped_fetch_files():
    ok = to_response(RunOutcome(return_code=0, fetch_notes={"/etc/passwd": "outside the run's /tmp"}),
                     ("run_timeout 100 s clamped to the maximum 60 s",))
    assert ok.status == "Success"
    assert ok.message == ("run_timeout 100 s clamped to the maximum 60 s; "
                          "fetch_files '/etc/passwd' skipped: outside the run's /tmp")
    assert to_response(RunOutcome(return_code=0)).message == ""
