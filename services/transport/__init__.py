"""Wire contracts between services, and the clients that speak them.

Invariant: this package imports only ``services.common`` and ``services.proto_gen``; every
service (rollout, trainer, reward, sandbox) may import it, so two services share a protocol
without one importing the other's internals.
"""
