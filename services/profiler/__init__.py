"""The profiler service: profiles models on its device and measures its links, on request."""
