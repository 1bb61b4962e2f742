"""What a run is given and checks before it starts: preflight refusals, the checkpoint folder and its run state."""
