"""A DCP program and its files: the SPMD result of a transform, what it knows of the model, weight shards, context buckets."""
