"""Fixtures shared by the test suite (tests/) and the benchmarks (bench/), so neither imports
the other: a GGUF writer in llama.cpp's layout (gguf_writer), quantized Hugging Face
checkpoint writers (checkpoints), random-weight models of real shapes (real_shapes), and `pagewire serve` / `pagewire router` started as real
processes on 127.0.0.1 and ended by pid (server). Nothing in the engine imports this
package."""
