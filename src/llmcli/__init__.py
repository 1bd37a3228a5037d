"""llmcli: fast local chat and text generation with open-weight language models."""

__version__ = "0.1.0"
