"""How a weight push authenticates: the shared token travels as gRPC metadata under this key.

Invariant: client and server read the key from here only, so they cannot disagree on it.
"""

TOKEN_METADATA_KEY = "x-retool-token"
