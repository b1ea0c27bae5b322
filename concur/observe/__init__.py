"""Measuring, tuning and reporting: the NVML monitor, timing, profiler traces, run directories,
``concur report``, and the measured tuner, which times a whole step per configuration, with its disk cache.
"""
