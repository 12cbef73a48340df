"""The torch runtime's engines: the compact Llama slot engine and its row-invariant CPU kernels, the Hugging Face fallback, model loading."""
