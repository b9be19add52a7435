"""`bema eval` and `bema rescore`: tasks, backends, benchmark data, results files, the eval loop."""
