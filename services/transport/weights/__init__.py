"""Weight push over gRPC: the bucketed wire format, delta encoding, shared-memory layout and the
trainer-side client. The replica-side server lives in ``services.rollout.weights``."""
