"""The tritonserver process: finding an installation, launching it on loopback ports, keeping it up
(the supervisor restarts it after a crash), stopping it in seconds (the drain), its process group."""
