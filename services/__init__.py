"""ReTool services: sandbox, reward, rollout, trainer and what they share."""
