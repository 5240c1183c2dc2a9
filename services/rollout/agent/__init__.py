"""Tool agent: parse tool calls, run them in the sandbox, and drive the multi-turn generation loop."""
