"""llmcli's own forward pass for the Llama family, its KV cache, and its CUDA graphs."""
