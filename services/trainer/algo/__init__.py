"""Pure RL algorithm pieces (no I/O, no distributed state): advantages, losses, DAPO, metrics."""
