"""grpo_train: a compact GRPO trainer on top of grpo_kernels' fused loss."""
