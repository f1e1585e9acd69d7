"""Multi-turn rollouts: the agent loop, its tools and interactions, and exact token accounting."""
