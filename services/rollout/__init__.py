"""Rollout service: multi-turn tool-using generation, weights swapped in place over gRPC."""
