"""The model and its modules: the encoder/LLM split (model), the LLM and vision towers, the hand-off, the loss, the
families' adapters, and how a module is parallelized (parallelize) and pipelined (pipeline)."""
