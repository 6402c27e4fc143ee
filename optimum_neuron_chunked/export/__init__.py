"""Export pipeline and the `optimum-cli export neuron` command."""
