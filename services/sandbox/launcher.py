"""The sandbox service as a child process (demo, benchmarks, tests)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from services.common.process import ServiceProcess


class SandboxProcess(ServiceProcess):
    def __init__(self, extra_args: Sequence[str] = (), *, port: int | None = None, host: str = "127.0.0.1",
                 env: Mapping[str, str] | None = None, log_path: str | None = None,
                 wrapper: Sequence[str] = ()) -> None:
        super().__init__(["sandbox", "serve", *extra_args], port=port, host=host, env=env, log_path=log_path,
                         wrapper=wrapper)
