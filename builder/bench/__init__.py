"""``specbuild bench``: side-by-side speed, latency and acceptance of every decoding method
and of the peer (Hugging Face transformers' generate), in one process and one sitting."""
