"""kernels: attention over the paged KV cache and the fused ops around it.

One file per kernel family. Each holds a plain-torch reference and the path used on this
device; Triton kernels for CUDA join them file by file. Imports nothing of the project.
"""
