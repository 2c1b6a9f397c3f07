"""Recording stand-ins for ttnn and for a tt-metal model, for contract tests on chipless hosts."""
