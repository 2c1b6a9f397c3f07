"""The worker's plan, made before any device opens: the backend, mesh and fabric (mesh.py), the
`tt` options (options.py), the model class (registry.py) and its checkpoint (model_prepare.py,
tiny_vlm.py), judged together in preflight.py."""
