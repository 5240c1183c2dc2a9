"""Sandbox service: SandboxFusion-compatible ``/run_code`` on warm, isolated Python workers."""
