"""The shared core: typed configs, errors, statistics, sampling, text, tree topology, the reference model cache. Imports nothing else of the package."""
