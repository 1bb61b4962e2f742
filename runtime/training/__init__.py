"""Training: the trainer, its step inputs, a rank's model and optimizer, the step loop."""
