"""Compute kernels: Triton implementations with plain-torch twins, chosen at one dispatch point.

Everything the model layers call lives in `kernels.ops`. Nothing here knows about requests.
"""
