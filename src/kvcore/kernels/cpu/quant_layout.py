"""The quantized weights' layout constants, shared by the formats (quant.py) and the compiled
kernels (quant_gemm.py) without either importing the other."""

BLOCK = 32  # weights per scale block of the q4 / q8 formats (GGUF's block size)
TILE = 16  # weight rows per kernel tile (and the row padding)
