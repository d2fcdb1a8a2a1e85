"""Ray actors and Ray Serve integration: thin wrappers around raykv objects.

Modules here may import ray; nothing in raykv/ imports from here except lazily.
"""
