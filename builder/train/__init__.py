"""Training drafters on the target's own outputs: target data, distillation, Medusa heads, EAGLE, held-out acceptance."""
