"""The device worker (docs/architecture.md, "The worker").

At the top, the service and the runner it drives: `__main__`, `config` (flags, start-up),
`server` (device.proto), `wire` (protobuf <-> domain objects, the only module that builds
messages), `metrics`; `runner` (steps -> generator-contract calls), `device` (the interface a
backend implements), `batch` (domain objects), `sampling` (the host sampler), `step_check`.
`planning/`: what the worker decides before a device opens (`ttserve check` prints it).
`backends/`: one package per kind of device (torch, sim, ttnn).
"""
