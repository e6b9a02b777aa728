"""The algorithm: PPO maths as pure tensor functions (`ppo`), the CORY episode (`cory`), one
agent's update (`update`), the agents' learning state (`state`), Elastic Reset (`elastic`) and
one iteration's metrics (`metrics`)."""
