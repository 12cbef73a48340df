"""Planning: the build spec, GPU catalogue, model shapes and the memory planner."""
