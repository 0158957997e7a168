"""The Pallas kernels and the backends that run them: what a backend is
(`backend`, `backends`), the GPU's (`backend_triton`) and the TPU's
(`backend_mosaic_tpu`, `kernel_tpu_groups`), interpret mode
(`backend_interpret`), the shared toolkit and the tile kernels
(`kernel_toolkit`, `kernel_forward`, `kernel_backward`, `schedule`), and
compiling for a chip without one (`deviceless`).
"""
