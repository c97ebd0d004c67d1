"""plait: predict iteration time and memory of hybrid-parallel LLM training."""
