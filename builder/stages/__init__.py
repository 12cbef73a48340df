"""The build pipeline's stages: torch weights -> quantize + export TensorRT-LLM checkpoints -> compile -> render the model repository -> manifest."""
