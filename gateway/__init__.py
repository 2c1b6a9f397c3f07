"""The gateway: vLLM's OpenAI HTTP frontend with its engine core replaced by a gRPC client of
the ttserve control plane. Entry points: `config.add_arguments` / `config.run`, or
`python -m ttserve.gateway`. Importing this package does not import vLLM."""
