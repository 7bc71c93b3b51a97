"""Benchmarks of jitckpt against the tools users would otherwise pick.

Every benchmark runs jitckpt and its peers in the same run, on the same
machine, against the same S3 server and the same model, and reports ratios:
absolute times on a shared machine are noise, ratios much less so.
"""
