"""Weight push, replica side: the gRPC server that validates and applies pushes to the engine.

The wire format and the trainer-side client are ``services.transport.weights``.
"""
