"""`keepalive`: keep heads resumable against foreign traffic."""
