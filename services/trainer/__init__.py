"""ReTool trainer: GRPO/DAPO/PPO losses, padding-free packing, FSDP2 training step."""
