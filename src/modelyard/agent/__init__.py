"""The agent beside one inference-server replica: loads and unloads models as the scheduler says."""
