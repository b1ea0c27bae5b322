"""Measuring, tuning and reporting: the NVML monitor, timing, profiler traces, run directories,
``concur report``, and the measured tuner behind ``streams="auto"`` with its disk cache.
"""
