"""Code that runs in the notebook's kernel: the magic, the cluster, the runner, the results."""
