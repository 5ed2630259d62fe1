"""Real engines as test peers: llama.cpp's llama-server (`llama_peer`) and its fixtures."""
