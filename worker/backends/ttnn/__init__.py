"""The ttnn backend: tt-metal's model classes on a ttnn mesh (backend.py: TtnnBackend), the chips
and the mesh's life (mesh_device.py, torch-free), and tt-metal's rules for its classes
(tt_models.py, pure Python)."""
