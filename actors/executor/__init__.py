"""The executor: owns the weights and the KV cache, runs each StepPlan's forward pass and
samples. Only this package imports torch model code."""
