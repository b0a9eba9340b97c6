"""The engine core process: its step loop, its messages to and from the client, test-only fault injection."""
