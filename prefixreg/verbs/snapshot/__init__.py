"""`snapshot`: save and restore llama.cpp KV snapshots of heads, proven by pinned checks."""
