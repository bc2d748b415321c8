"""Code that runs inside the ipyparallel engines.

Everything here imports only the standard library at module level: the engines import torch or
TensorFlow when a job needs them, and the notebook kernel imports this package without either.
"""
