"""One package per kind of device, each implementing worker/device.py's DeviceBackend: torch
(ttserve's reference models), sim (a simulated Tenstorrent mesh, driven by the torch backend) and
ttnn (tt-metal's model classes on a ttnn mesh). Their __init__ modules import nothing, so that a
host without torch (or without ttnn) can import the parts of a backend it needs."""
