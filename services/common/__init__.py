"""Code shared by every service: config, logging, metrics, HTTP helpers."""
