"""Inference: the hot loop, the backends that run the forward pass, sampling and detokenizing."""
