"""Weight push over gRPC: trainer-side client, replica-side server, bucketed wire format."""
