"""Generation engines behind one async, token-in/token-out interface."""
