"""wire: every message between pagewire's actors, and the typed channels that carry them.

Imports only msgspec, zmq and the standard library.
"""
from .sampling_params import InvalidParam, SamplingParams

__all__ = ["InvalidParam", "SamplingParams"]
