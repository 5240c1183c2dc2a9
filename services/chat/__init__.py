"""How a tool-using conversation becomes tokens: prompts, tool-call syntax, tool results.

Invariant: the rollout agent loop and the SFT renderer both take the chat layout from here, so
what SFT trains on is token for token what rollout generates and appends; this package imports
only ``services.common`` and the wire contracts of ``services.transport`` (a tool result is
rendered from the sandbox's typed answer).
"""
