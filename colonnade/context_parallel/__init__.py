"""Context parallelism: the sequence split across cp ranks, through attention as well."""
