"""vLLM platform plugin (see the vLLM plugin issue); nothing is registered yet."""
