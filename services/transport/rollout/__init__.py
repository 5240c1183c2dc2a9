"""The rollout service's HTTP contract as a client: prompt jobs in, scored groups out."""
