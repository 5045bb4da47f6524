"""Pipeline parallelism: the flat list of layer specs, its chunks, and the sequential twin."""
