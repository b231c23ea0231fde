"""llmgw-systemd: multi-node LLM replicas as linked systemd units."""

__version__ = "0.1.0"
