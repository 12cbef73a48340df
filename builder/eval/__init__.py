"""Measuring a quantized model against its float32 original: greedy agreement, perplexity."""
