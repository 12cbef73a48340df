"""In-flight batching: the scheduler that runs every active request's round in one ragged engine pass."""
